"""LoRA adapters on one loaded base model (docs/adapters.md): PEFT directories read and checked against the
model (peft_files), the model's target linears wrapped once so that each step adds every row's own adapter
(layers), and the resident adapters by name and id (adapters)."""
