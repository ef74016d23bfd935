"""The other engines' runs of a bench workload (after pagedserve's stack has stopped): vLLM's CPU engine and
llama.cpp's server, each with its figures, a line on how it ran and its settings for the JSON."""

import argparse
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from cli.bench import llamacpp_peer, vllm_peer
from cli.bench.workloads import Workload
from common.model_files import local_copy

PEERS = {"vllm": vllm_peer.NAME, "llamacpp": llamacpp_peer.NAME}


@dataclass
class PeerRun:
    figures: dict
    setup: str
    settings: dict = field(default_factory=dict)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer", action="append", choices=list(PEERS), default=[],
        help="also run the workload on this engine (vllm: vLLM's CPU engine, from --vllm-python; llamacpp: "
        "llama.cpp's server on the GGUF of --model, from --llamacpp-server); repeat for both",
    )  # fmt: skip
    vllm_peer.add_flags(parser)
    llamacpp_peer.add_flags(parser)


def check_flags(args: argparse.Namespace) -> None:
    """SystemExit for a peer that cannot run (before anything starts)."""
    vllm_peer.check_flags(args)
    llamacpp_peer.check_flags(args)


def _failed(name: str, error: Exception) -> PeerRun:
    # NOTE: pagedserve's and the other peers' figures are still worth printing; the column stays empty.
    print(f"pagedserve bench: {error}", file=sys.stderr)
    return PeerRun({}, f"{name} failed: {str(error).splitlines()[0]}")


def vllm(args: argparse.Namespace, workload: Workload, dtype: str) -> PeerRun:
    print(f"{workload.name}: vLLM peer (it compiles for ~2 minutes at each start)", file=sys.stderr)
    try:
        figures = vllm_peer.measure(
            args.vllm_python, workload, local_copy(args.model).path, dtype, args.repeat,
            kv_memory=args.vllm_kv_memory, bind=args.vllm_bind, dummy_weights=bool(args.model_shape),
            draft_tokens=args.draft_tokens,
        )  # fmt: skip
    except (RuntimeError, ValueError) as error:
        return _failed(vllm_peer.NAME, error)
    settings = vllm_peer.settings(figures, args, dtype)
    figures.pop("binding_log")
    return PeerRun(figures, vllm_peer.setup(figures, args, dtype), settings)


def llamacpp(args: argparse.Namespace, workload: Workload) -> PeerRun:
    binary = args.llamacpp_server
    try:
        settings = {
            "version": llamacpp_peer.version(binary),
            "binary": binary,
            **llamacpp_peer.server_settings(
                workload, args.model, args.llamacpp_threads, args.llamacpp_repack
            ),
        }
        total = sum(r.max_tokens for r in workload.requests) * args.repeat
        with tqdm(total=total, desc=f"{workload.name}, llama.cpp", unit="tok", file=sys.stderr) as bar:
            figures = llamacpp_peer.measure(binary, workload, settings, args.repeat, bar.update)
    except (RuntimeError, ValueError, OSError) as error:
        return _failed(llamacpp_peer.NAME, error)
    return PeerRun(figures, llamacpp_peer.setup(settings, args.repeat), settings)
