"""The compute service's flags, for `python -m compute_service` and `pagedserve up`."""

import argparse

from common import sparse_settings
from common.options import ServiceOptions, add_dtype, add_kv_device, add_kv_dtype, add_logging, add_model
from common.transport import add_listen
from compute_service.attention.backend_names import BACKEND_NAMES, SPARSE
from compute_service.weight_modes import INT4_GROUP_SIZE, WEIGHTS_CHOICES

# --pooling: as the model declares, none, or a mode of compute_service.pooling (declared here: the launcher
# imports these options without torch or transformers).
POOLING = ("auto", "off", "last", "mean", "cls")


def _length(text: str) -> int:
    """--max-model-len: a token count >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (an integer >= 0)")
    return int(text)


def _sparse(text: str) -> sparse_settings.SparseMode | None:
    """--sparse-attention: off, allow, on, or sink=S,recent=R,topk=K after allow or on or alone."""
    try:
        return sparse_settings.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _ranks(text: str) -> int:
    """--tensor-parallel-size: a rank count >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank count (an integer >= 1)")
    return int(text)


def add_parallel(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        type=_ranks,
        default=1,
        help="split the model's attention heads, KV heads and MLP columns over this many ranks (processes "
        "on torch.distributed, gloo on the cpu; docs/scaling.md), rank 0 serving the gateway (default 1)",
    )


def add_rank(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dist-init-addr",
        default="",
        metavar="HOST:PORT",
        help="with --tensor-parallel-size: where the ranks meet (rank 0's torch.distributed TCP store); "
        "default: rank 0 starts the other ranks itself on a free loopback port, or torchrun's environment "
        "(MASTER_ADDR/MASTER_PORT) for a rank > 0",
    )
    parser.add_argument(
        "--shard-rank",
        type=int,
        default=0,
        help="this process's rank in the group (default 0, the one that serves the gateway and starts the "
        "others unless --dist-init-addr is given; RANK under torchrun); a rank > 0 serves no gRPC",
    )


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attention-backend",
        choices=["auto", *BACKEND_NAMES],
        default="auto",
        help="paged attention backend (default auto: the --kv-device's own; on the cpu, cpu-native for "
        "float32 where the native kernels build, else cpu; cuda also runs on the cpu, its torch path, to "
        "check it)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--single-stream-threads",
        type=int,
        default=None,
        help="torch threads for a step of one new token (default: one per physical core compute may use, at "
        "most --threads: SMT siblings count once)",
    )
    parser.add_argument(
        "--plain-linear",
        action="store_true",
        help="keep nn.Linear as is (default: float32 CPU linears on weights packed once, native panels where "
        "the kernels build, else oneDNN; the start-up line execution_plan names them)",
    )
    parser.add_argument(
        "--max-model-len",
        type=_length,
        default=0,
        help="the longest sequence (prompt + output tokens) served; 0 (default): the model's own length "
        "(its max_position_embeddings, or the original length of a dynamic or longrope rotary embedding)",
    )
    parser.add_argument(
        "--sparse-attention",
        type=_sparse,
        default=None,
        metavar="off|allow|on[,sink=S,recent=R,topk=K]",
        help="block-sparse decode: a decode of a full-attention layer attends only to its first S blocks, "
        "its last R and the K between whose keys' min/max bounds score highest (default sink=1,recent=4,"
        "topk=8); allow: requests may ask for it (GenerateRequest.sparse_attention), dense otherwise; on or "
        "settings alone: every decode unless its request asks for dense; off (default): requests may not "
        f"ask; prompts stay dense; attention backend {' or '.join(SPARSE)} only (docs/sparse-attention.md)",
    )
    parser.add_argument(
        "--pooling",
        choices=POOLING,
        default="auto",
        help="how embeddings (Embed, /v1/embeddings) pool the hidden states: auto (default) as the model "
        "declares (a sentence-transformers modules.json), else not at all; off: embeddings refused; last, "
        "mean or cls: that token pooling, normalised unless the model declares pooling without Normalize "
        "(a plain decoder: last; docs/embeddings.md)",
    )
    parser.add_argument(
        "--classifier-from-token",
        nargs="+",
        metavar="TOKEN",
        default=None,
        help="serve a causal LM as a scoring model (POST /v1/score, /v1/rerank) from its output logits at "
        "the last token, as vLLM's classifier_from_token: NO YES (a Qwen3-Reranker: the score is "
        "softmax([NO, YES])[YES]) or one TOKEN (the sigmoid of its logit); docs/embeddings.md",
    )
    parser.add_argument(
        "--encoder-cache-images",
        type=_length,
        default=64,
        help="vision-language models: the encoded images compute keeps (least recently used dropped first) "
        "where the cache's image store does not hold them, so that a repeated image skips the vision encoder "
        "(default 64; 0: none; docs/vision.md#image-store)",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="keep transformers' layer forward (default: float32 Llama models run fused QKV and gate/up "
        "projections and a lighter layer forward)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="how linear layers hold weights: auto (= --dtype), bfloat16 (with --dtype float32: bfloat16 "
        "products, the rest float32; needs AVX512-BF16 or AMX), int8 (per output channel) or int4 (groups of "
        f"{INT4_GROUP_SIZE}); int8 in a float32 model runs native int8 panels, the rest torch's weight-only "
        "kernels on decode-sized batches",
    )
    add_lora(parser)


def _lora_module(text: str) -> str:
    """--lora-modules: NAME=DIR, a name and a PEFT LoRA directory."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR (an adapter name and its PEFT directory)")
    return text


def add_lora(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters, loaded at run time (POST /v1/load_lora_adapter, LoadLoraAdapter); implied "
        "by --lora-modules (docs/adapters.md)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=DIR",
        help="LoRA adapters in PEFT's format (adapter_config.json, adapter_model.safetensors) resident from "
        "the start; a request names one by `model` (OpenAI) or lora_adapter (gRPC)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="adapters resident at once (default 4); a step mixes any of them beside the base model",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest adapter rank served (default 16)",
    )


def add_standby(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--standby",
        action="store_true",
        help="with --socket: load the model, then wait until the compute service serving on that socket "
        "exits and take its place (pagedserve up's warm standby; docs/reliability.md)",
    )


OPTIONS = ServiceOptions(
    "compute_service",
    50053,
    settings=(add_model, add_dtype, add_kv_dtype, add_kv_device, add_settings, add_parallel, add_logging),
    wiring=(add_listen, add_rank, add_standby),
)
