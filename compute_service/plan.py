"""The execution plan: which implementation runs each stage of a step for one loaded model, and why.

It is resolved once, before the weights load (compute_service.planning), from the model's config, the dtype,
the weights mode, the device, this machine (its CPU as common.cpu sees it, and whether the native kernels
build: compute_service.kernels) and compute's flags. The loader builds the model to it, the runner follows it,
compute logs it at start-up and `GetModelInfo` returns it (`pagedserve stats --compute-target` shows it).
Nothing else decides how a stage runs.

The stages (STAGES): the decoder layers' forward on steps with a prompt in them (`layers`) and on steps in
which every sequence decodes one token (`layers.decode`); the linear layers by shape class, the decoder
layers' projections (`linears.decoder`) and the vocabulary-wide output head (`linears.head`), which hold
their weights apart; attention over prompts and chunks (`attention.prefill`) and over decodes
(`attention.decode`, block-sparse under --sparse-attention); a batch of plain greedy rows
(`sampling.greedy`) and any other batch (`sampling`).
"""

from dataclasses import dataclass

from common.sparse_settings import SparseMode

# Implementations of the layers' forward.
TRANSFORMERS = "transformers"  # transformers' own modules, as loaded
FUSED = "fused"  # compute_service.fused: fused projections, one residual stream, attention called directly
NATIVE_STACK = "native-stack"  # compute_service.native_decode: every layer of an all-decode step in C++
# Kernels of a linear layer (compute_service.linear_kernels); TRANSFORMERS keeps nn.Linear.
PANELS = "panels"  # the native panel kernel, float32 or int8 weights
ONEDNN = "onednn"  # oneDNN's inner product on a weight reordered once, float32 or bfloat16
WEIGHT_ONLY = "weight-only"  # torch's int8/int4 weight-only kernels, a dense kernel for larger batches
DENSE = "dense"  # F.linear on a weight in the model's dtype
# Implementations of the greedy choice and of sampling.
NATIVE = "native"
TORCH = "torch"

STAGES = (
    "layers",
    "layers.decode",
    "linears.decoder",
    "linears.head",
    "attention.prefill",
    "attention.decode",
    "sampling.greedy",
    "sampling",
)


@dataclass(frozen=True)
class Choice:
    """How one stage runs, and why (a sentence an operator can act on)."""

    implementation: str
    reason: str


@dataclass(frozen=True)
class LinearChoice:
    """How one shape class of linear layers holds its weights and multiplies by them: `kernel` on weights
    held as `weights` (a dtype name, int8 or int4); a WEIGHT_ONLY kernel runs up to `max_rows` rows and
    `dense` above."""

    kernel: str
    weights: str
    reason: str
    max_rows: int = 0
    dense: "LinearChoice | None" = None

    def __post_init__(self) -> None:
        assert (self.kernel == WEIGHT_ONLY) == (self.dense is not None), self

    @property
    def implementation(self) -> str:
        if self.dense is None:
            return f"{self.kernel} {self.weights}"
        return f"{self.kernel} {self.weights} up to {self.max_rows} rows, {self.dense.implementation} above"

    def choice(self) -> Choice:
        return Choice(self.implementation, self.reason)


@dataclass(frozen=True)
class Machine:
    """What the plan was resolved for: the CPU's widest vector ISA and capability profile (common.cpu),
    whether the native kernels are built and loaded, whether bfloat16 products are native, whether torch
    has oneDNN."""

    isa: str
    profile: str
    kernels: bool
    bfloat16_native: bool
    onednn: bool


@dataclass(frozen=True)
class ExecutionPlan:
    """One loaded model's plan (see the module docstring); `architecture` is the config's model_type,
    `max_model_len` the longest sequence served (--max-model-len, else the model's own length)."""

    architecture: str
    max_model_len: int
    device: str
    dtype: str
    weights: str
    kv_dtype: str
    machine: Machine
    attention_backend: str
    layers: Choice
    decode_layers: Choice
    decoder_linears: LinearChoice
    head_linear: LinearChoice
    attention_prefill: Choice
    attention_decode: Choice
    greedy: Choice
    sampling: Choice
    # --sparse-attention: which decodes of the full-attention layers may attend to some blocks only, and which
    # do by default (None: every decode dense, requests may not ask).
    sparse_attention: SparseMode | None = None
    # LoRA adapters (--enable-lora, --lora-modules): how a step's adapter rows run (None: LoRA off).
    lora: Choice | None = None

    @property
    def fused(self) -> bool:
        return self.layers.implementation == FUSED

    @property
    def native_decode(self) -> bool:
        return self.decode_layers.implementation == NATIVE_STACK

    @property
    def native_greedy(self) -> bool:
        return self.greedy.implementation == NATIVE

    def stages(self) -> dict[str, Choice]:
        """Every stage's choice, by name, in STAGES order."""
        choices = (
            self.layers,
            self.decode_layers,
            self.decoder_linears.choice(),
            self.head_linear.choice(),
            self.attention_prefill,
            self.attention_decode,
            self.greedy,
            self.sampling,
        )
        stages = dict(zip(STAGES, choices, strict=True))
        return stages if self.lora is None else {**stages, "lora": self.lora}

    def summary(self) -> dict[str, str]:
        """The plan as flat strings, for the start-up log line: what it was resolved for, and each stage's
        implementation (the reasons are in GetModelInfo)."""
        machine = self.machine
        return {
            "architecture": self.architecture,
            "device": self.device,
            "isa": f"{machine.isa} (profile {machine.profile})",
            "native_kernels": "built" if machine.kernels else "unavailable",
            "attention_backend": self.attention_backend,
            **{stage: choice.implementation for stage, choice in self.stages().items()},
        }
