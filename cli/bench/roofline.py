"""A run's figures as shares of the machine's ceilings (cli/bench/ceilings.py): the float32 FLOPs its prompts
took per second, against the FMA peak, and the bytes a decode step reads per second, against the read
bandwidth. Counted from the model's config, the same for every engine:

- prompt FLOPs: 2 per weight of the layers' linears per computed prompt token (the LM head runs on a
  prompt's last token only), and 4 × head_dim per query head and layer per key each computed token
  attends to (its scores and its weighted sum); over the span in which the prompts were computed (first
  request sent to last first token).
- decode bytes: every weight the step multiplies by (the layers' linears and the LM head, at the weights'
  width), and the K/V of each stream's context (half its new tokens past its prompt, on average); the
  streams a step serves are generated tokens/s × the inter-token p50 (tokens in flight per stream), the
  step's time the inter-token p50.

A model of experts (MoE) or without a Llama-shaped config gets none of these figures."""

import json
import sys
from dataclasses import dataclass

from cli.bench import ceilings as machine
from cli.bench import llamacpp_peer, vllm_peer
from cli.bench.workloads import Workload
from common.model_files import local_copy

# Bytes per weight: llama.cpp's Q4_1 holds 32 weights in 20 bytes (4-bit levels, a float16 scale and minimum).
WIDTHS = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5, "q4_1": 0.625}
KV_WIDTHS = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True, slots=True)
class ModelCost:
    layer_weights: int  # every layer's linears: q, k, v, o, gate, up, down
    head_weights: int  # the LM head
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict) -> "ModelCost | None":
        """From a Hugging Face config.json (a text config inside a multimodal one); None for a model of
        experts or one lacking the Llama-shaped sizes."""
        config = config.get("text_config", config)
        if any(config.get(key) for key in EXPERT_KEYS):
            return None
        try:
            hidden, inter = config["hidden_size"], config["intermediate_size"]
            layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads") or heads
            head_dim = config.get("head_dim") or hidden // heads
            vocab = config["vocab_size"]
        except KeyError:
            return None
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
        return cls(
            layers * (attention + 3 * hidden * inter), vocab * hidden, layers, heads, kv_heads, head_dim
        )

    def prompt_flops(self, tokens: float, keys: float) -> float:
        """FLOPs of `tokens` computed prompt tokens that attend to `keys` keys in all."""
        return 2.0 * self.layer_weights * tokens + 4.0 * self.head_dim * self.q_heads * self.layers * keys

    def decode_bytes(self, weights: str, kv_dtype: str, context: float, streams: float) -> float:
        """Bytes a decode step of `streams` streams of `context` tokens each reads."""
        kv_token = 2 * self.layers * self.kv_heads * self.head_dim * KV_WIDTHS.get(kv_dtype, 4.0)
        return (self.layer_weights + self.head_weights) * WIDTHS.get(
            weights, 4.0
        ) + kv_token * context * streams


def shares(figures: dict, cost: ModelCost, ceilings: dict, workload: Workload, weights: str, kv: str) -> dict:
    """prompt_gflop_per_s, decode_gb_per_s and their shares of the ceilings, from one engine's figures (None
    where the figures lack what they need)."""
    out = dict.fromkeys(("prompt_gflop_per_s", "prompt_fma_share", "decode_gb_per_s", "decode_read_share"))
    computed = (figures.get("prompt_tokens") or 0) - (figures.get("cached_prompt_tokens") or 0)
    rate, keys = figures.get("prompt_tokens_per_s"), figures.get("prompt_attention_keys")
    if computed > 0 and rate and keys is not None:
        gflops = cost.prompt_flops(computed, keys) / (computed / rate) / 1e9
        out["prompt_gflop_per_s"], out["prompt_fma_share"] = gflops, gflops / ceilings["fma_gflop_per_s"]
    itl, generated = figures.get("itl_p50_ms"), figures.get("generated_tokens_per_s")
    if itl and generated:
        requests = workload.requests
        context = sum(len(r.prompt_ids) + r.max_tokens / 2 for r in requests) / len(requests)
        streams = max(1.0, generated * itl / 1e3)
        gbs = cost.decode_bytes(weights, kv, context, streams) / (itl / 1e3) / 1e9
        out["decode_gb_per_s"], out["decode_read_share"] = gbs, gbs / ceilings["read_gb_per_s"]
    return out


def add_shares(
    result: dict, cost: ModelCost, ceilings: dict, workload: Workload, weights: dict[str, str]
) -> None:
    """Every engine's figures in `result` (pagedserve's and each peer's) gain their shares; `weights`: each
    engine's weights and KV dtypes as (weights, kv), by its name in result["peers"] ("pagedserve" too)."""
    engines = {"pagedserve": result["pagedserve"], **result.get("peers", {})}
    for name, figures in engines.items():
        if figures and name in weights:
            figures.update(shares(figures, cost, ceilings, workload, *weights[name]))


def measure_ceilings() -> dict | None:
    """The machine's ceilings (cli/bench/ceilings.py), or None, said on stderr, where they cannot be
    measured."""
    print("the machine's ceilings: float32 FMA and memory reads", file=sys.stderr)
    try:
        return machine.measure()
    except RuntimeError as error:
        print(f"pagedserve bench: {error}", file=sys.stderr)
        return None


def add_to(result: dict, model: str, ceilings: dict, workload: Workload, dtypes: dict[str, str]) -> None:
    """`result` gains the ceilings and every engine's shares of them, for `model` (a name or directory);
    `dtypes`: pagedserve's dtype, weights and kv_dtype, and the vLLM peer's dtype (as "vllm")."""
    result["ceilings"] = ceilings
    cost = ModelCost.from_config(json.loads((local_copy(model).path / "config.json").read_text()))
    if cost is None:
        return
    ours = (dtypes["weights"], dtypes["kv_dtype"])
    weights = {
        "pagedserve": ours,
        "prefix cache off": ours,
        "generate_batch": (dtypes["dtype"], dtypes["dtype"]),
        "generate": (dtypes["dtype"], dtypes["dtype"]),
        vllm_peer.NAME: (dtypes["vllm"], dtypes["vllm"]),
        llamacpp_peer.NAME: ("q4_1", "float16"),
    }
    add_shares(result, cost, ceilings, workload, weights)
