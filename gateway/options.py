"""The gateway's flags, for `python -m gateway` and `pagedserve up`."""

import argparse
import math
from pathlib import Path

from common.options import ServiceOptions, add_logging, add_model, positive_seconds
from common.paging import MAX_DECODE_STEPS, MAX_DRAFT_TOKENS
from common.transport import add_client_certs
from gateway.config import (
    DEFAULT_DECODE_STEP_TARGET_MS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_ENCODER_BUDGET,
    DEFAULT_PACE_STREAMS,
    DEFAULT_PREFILL_THRESHOLD,
)
from gateway.limits import add_limits
from gateway.reasoning.formats import NAMES as REASONING_PARSERS
from gateway.structured.limits import add_constraint_limits
from gateway.tools.formats import FORMATS as TOOL_PARSERS


def add_targets(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-target", default="127.0.0.1:50052", help="the cache service, HOST:PORT or unix:PATH"
    )
    parser.add_argument(
        "--compute-target", default="127.0.0.1:50053", help="the compute service, HOST:PORT or unix:PATH"
    )
    parser.add_argument(
        "--prefill-compute-target",
        default="",
        help="a prefill compute, HOST:PORT or unix:PATH, serving the model beside --compute-target on the "
        "same host: long prompt chunks run there while the decodes go on (docs/scaling.md); default: none",
    )
    add_client_certs(parser, with_identity=False)


# `pagedserve up` and compose serve the HTTP API here by default; a bare gateway only when asked.
UP_HTTP_PORT = 8000


def add_http(parser: argparse.ArgumentParser) -> None:
    """Where the OpenAI-compatible HTTP API listens: placement, like --port (`pagedserve up` decides it)."""
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="HTTP port on --host: the OpenAI-compatible API and /dashboard (HTTPS with --tls-cert); "
        f"0: off, up: {UP_HTTP_PORT}",
    )


def _tokens(text: str) -> int:
    """A flag's token count: an integer >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (an integer >= 0)")
    return int(text)


def _target_ms(text: str) -> float:
    """--decode-step-target-ms: a finite number of milliseconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give milliseconds, a number >= 0 (0: off)")
    return value


def _streams(text: str) -> int:
    """--pace-streams: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a stream count, an integer >= 1")
    return int(text)


def _decode_steps(text: str) -> int:
    """--decode-steps: an integer in [1, MAX_DECODE_STEPS]."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_DECODE_STEPS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a step count from 1 to {MAX_DECODE_STEPS}")
    return int(text)


def _draft_tokens(text: str) -> int:
    """--draft-tokens: an integer in [0, MAX_DRAFT_TOKENS]."""
    if not text.isdigit() or int(text) > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token count from 0 to {MAX_DRAFT_TOKENS}")
    return int(text)


def add_step_sizing(parser: argparse.ArgumentParser) -> None:
    """How much prompt a step that runs decodes takes, and how many decode steps one compute call runs
    (`pagedserve bench` forwards them too)."""
    parser.add_argument(
        "--prefill-tokens-with-decodes",
        type=_tokens,
        default=512,
        help="prompt tokens of a step that also runs decodes, so streams do not stall behind a long "
        "prefill (0: no cap below --max-batched-tokens)",
    )
    parser.add_argument(
        "--decode-step-target-ms",
        type=_target_ms,
        default=DEFAULT_DECODE_STEP_TARGET_MS,
        help="milliseconds a step that runs decodes aims at: its prompt tokens are sized from the measured "
        "step times (at least 64, at most --prefill-tokens-with-decodes), so streams wait about this long "
        "at worst; 0: off, the token cap alone",
    )
    parser.add_argument(
        "--pace-streams",
        type=_streams,
        default=DEFAULT_PACE_STREAMS,
        help="running streams beside which the two above hold as given; beside fewer, a step may take "
        "this / streams times as many prompt tokens and as long, so a burst's first streams wait once "
        "while the rest of the burst is prefilled; 1: they hold beside any number",
    )
    parser.add_argument(
        "--decode-steps",
        type=_decode_steps,
        default=DEFAULT_DECODE_STEPS,
        help="decode steps one compute call may run back to back (compute feeds each sampled token into "
        "the next step), so the round trip is paid once per call; fewer where the KV blocks for them are "
        f"short; 1: one call per step; at most {MAX_DECODE_STEPS}",
    )
    parser.add_argument(
        "--draft-tokens",
        type=_draft_tokens,
        default=0,
        help="prompt lookup: in a multi-step call, a greedy row whose last tokens recur earlier in its "
        "prompt or output feeds up to this many of the tokens that followed them as drafts, and keeps "
        "those the model agrees with, several tokens a step for about one step's cost; the tokens are "
        f"the greedy ones either way; 0: off; at most {MAX_DRAFT_TOKENS}",
    )


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-batched-tokens", type=int, default=4096, help="tokens of one step: decodes, then prompt chunks"
    )
    add_step_sizing(parser)
    parser.add_argument(
        "--encoder-budget",
        type=int,
        default=DEFAULT_ENCODER_BUDGET,
        help="image tokens of one step (vision-language models): a prompt chunk that would reach an image "
        "beyond them stops before it, unless the step has no image yet (docs/vision.md)",
    )
    parser.add_argument("--max-seqs", type=int, default=64, help="sequences running at once")
    parser.add_argument(
        "--prefill-threshold",
        type=_tokens,
        default=DEFAULT_PREFILL_THRESHOLD,
        help="with a prefill compute: a prompt chunk runs there when its sequence has at least this many "
        "tokens left to compute; shorter ones stay on the decode compute (docs/scaling.md)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("auto", *TOOL_PARSERS),
        default="auto",
        help="how tool calls are read from the model's text (and forced calls written); auto: from the chat "
        "template (hermes: <tool_call> JSON, also the format of the tool prompt for templates that render no "
        "tools; llama3_json, mistral, qwen3_coder, pythonic, openai (alias harmony: gpt-oss): "
        "docs/tool-calling.md)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="how a reasoning model's reasoning is split from its chat answers (reasoning_content); auto: "
        "from the reasoning tags the chat template writes (qwen3, deepseek_r1: <think>; mistral: [THINK]; "
        "openai_gptoss, alias harmony: gpt-oss's analysis channel); none: never split (docs/reasoning.md)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEXT",
        help="the Jinja chat template chat requests are rendered with (a file, or the template itself), in "
        "place of the model's own; for models whose files carry none",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME[,NAME...]",
        help="the name(s) requests give as `model` and responses carry (the first); default: the model's",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM (new ones are refused meanwhile)",
    )
    parser.add_argument(
        "--session-ttl",
        type=positive_seconds,
        default=10.0,
        help="seconds the cache service keeps this gateway's sequences unrenewed (renewed every third)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=256,
        help="concurrent Generate streams; more are refused (RESOURCE_EXHAUSTED), so threads stay for health",
    )
    parser.add_argument(
        "--peer-restart-grace",
        type=float,
        default=30.0,
        help="seconds a lost cache or compute service has to come back before waiting requests fail",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=0.0,
        help="seconds a compute step may take before compute counts as lost; 0: 10x the recent p99, >= 5 s",
    )
    # Tests only (docs/testing.md, Faults in a step): MODULE:NAME[=ARG], NAME(ARG) called as each stage of a
    # step begins (gateway/step_runner.py: StepHook).
    parser.add_argument("--step-hook", default="", help=argparse.SUPPRESS)


def _directory(text: str) -> Path:
    """An existing directory, resolved."""
    path = Path(text).resolve()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is no directory")
    return path


def add_edge(parser: argparse.ArgumentParser) -> None:
    """The public edge: TLS, API keys, prefix-cache namespaces (docs/security.md)."""
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain): serve TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--api-keys", type=Path, default=None, help="file of NAME:KEY lines: requests need a key (Bearer)"
    )
    parser.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let requests of different API keys share prefix-cache blocks (default: one namespace per key)",
    )
    parser.add_argument(
        "--http-metrics",
        choices=("off", "on"),
        default="off",
        help="on: also serve the Prometheus /metrics on --http-port, open like /health (vLLM serves its "
        "metrics on its API port, where the Gateway API Inference Extension's endpoint picker scrapes them)",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        type=_directory,
        default=None,
        help="image URLs may be file: URLs of files under this directory (resolved: no symlink or .. leads "
        "out); default: none are read (docs/security.md)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="image URLs may be http(s) URLs of these hosts, fetched by the gateway (redirects only to "
        "them); default: none are fetched (docs/security.md)",
    )


OPTIONS = ServiceOptions(
    "gateway",
    50051,
    settings=(add_model, add_settings, add_edge, add_limits, add_constraint_limits, add_logging),
    wiring=(add_targets, add_http),
)
