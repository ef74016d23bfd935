"""`pagedserve generate TEXT`: stream a completion to stdout."""

import argparse
import json
import sys
from pathlib import Path

from common.sampling_controls import CONTROLS, Kind
from common.sparse_settings import FIELDS
from sdk.client import API_KEY_ENV, Client, GenerationError, TokenLogprob
from sdk.resume import RESUME_TIMEOUT_S

DEFAULT_TARGET = "127.0.0.1:50051"


def _bias(value: str) -> tuple[int, float]:
    token, _, bias = value.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS such as 42=-100, got {value!r}") from None


# NOTE: the CLI prints one sample, so n is no flag; and it asks for more tokens than the server's default.
_NOT_FLAGS = {"n"}
_CLI_DEFAULTS = {"max_tokens": 64}


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per declared sampling control; an unset flag leaves the control to the server."""
    for c in CONTROLS.values():
        if c.name in _NOT_FLAGS:
            continue
        flag, text = "--" + c.name.replace("_", "-"), c.help.replace("%", "%%").replace("`", "")
        if c.kind is Kind.FLAG:
            p.add_argument(flag, action="store_true", default=None, help=text)
        elif c.kind is Kind.TOKEN_IDS:
            p.add_argument(flag.removesuffix("s"), dest=c.name, type=int, action="append", metavar="TOKEN_ID",
                           help=f"{text} (repeatable)")  # fmt: skip
        elif c.kind is Kind.TOKEN_BIAS:
            p.add_argument(flag, type=_bias, action="append", metavar="TOKEN_ID=BIAS",
                           help=f"{text}; bias in {c.range.text()} (repeatable)")  # fmt: skip
        elif c.kind is Kind.STRINGS:
            p.add_argument(flag, action="append", help=f"{text} (repeatable)")
        else:
            default = _CLI_DEFAULTS.get(c.name)
            shown = "none" if c.default is None else c.default if default is None else default
            p.add_argument(flag, type=float if c.kind is Kind.FLOAT else int, default=default,
                           help=f"{text} ({c.range_text()}; default {shown})")  # fmt: skip


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The SDK keyword arguments of the sampling flags that were given."""
    kwargs = {name: getattr(args, name) for name in CONTROLS if name not in _NOT_FLAGS}
    if kwargs["logit_bias"] is not None:
        kwargs["logit_bias"] = dict(kwargs["logit_bias"])
    return {name: value for name, value in kwargs.items() if value is not None}


def _sparse(text: str) -> bool | dict[str, int]:
    """--sparse-attention: on (True), off (False) or sink=S,recent=R,topk=K (any of them, each once)."""
    if text in ("on", "off"):
        return text == "on"
    settings: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in FIELDS or name in settings or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected on, off or comma-separated sink=S,recent=R,topk=K (integers, each once)"
            )
        settings[name] = int(value)
    return settings


def add_parser(commands) -> None:
    p = commands.add_parser(
        "generate",
        description="Streams the text to stdout; prompt and token logprobs (--prompt-logprobs, --logprobs) "
        "and a summary go to stderr.",
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, GIF, BMP) before the prompt in the user message (implies --chat; "
        "repeatable; a vision-language model, docs/vision.md)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="with --chat: variables for the chat template, a JSON object ('{\"enable_thinking\": false}'); "
        "a reasoning model's reasoning goes to stderr, its answer to stdout (docs/reasoning.md)",
    )
    _add_constraint_flags(p)
    _add_sampling_flags(p)
    p.add_argument(
        "--priority", type=int, default=0, help="lower is served first, equal ones by arrival (default 0)"
    )
    p.add_argument(
        "--lora-adapter",
        default="",
        metavar="NAME",
        help="generate with this LoRA adapter, by name (GetInfo and GET /v1/models list them; "
        "docs/adapters.md); default: the base model",
    )
    p.add_argument(
        "--sparse-attention",
        type=_sparse,
        default=None,
        metavar="off|on|sink=S,recent=R,topk=K",
        help="block-sparse decode for this request where the stack enables it (compute's --sparse-attention "
        "allow or on): on (the stack's settings), off (dense), or settings (any of them; the others the "
        "stack's); default: the stack's default (docs/sparse-attention.md)",
    )
    p.add_argument(
        "--target",
        action="append",
        help="gateway address HOST:PORT (default 127.0.0.1:50051); repeat it, or separate with commas, for "
        "several: a stream that breaks resumes on the next",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    p.add_argument(
        "--resume-timeout",
        type=float,
        default=RESUME_TIMEOUT_S,
        help="seconds a broken stream keeps trying to resume while no gateway answers "
        f"(default {RESUME_TIMEOUT_S:g}; 0: never)",
    )
    add_connection_flags(p)
    p.set_defaults(run=run)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object")
    return value


def _add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """Constrained decoding (docs/structured-outputs.md): one of these."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="the output is JSON this schema accepts"
    )
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", help="the output matches this regular expression")
    group.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    group.add_argument(
        "--grammar", type=Path, metavar="FILE", help="the output follows this Lark or GBNF grammar"
    )


def constraint_kwargs(args: argparse.Namespace) -> dict:
    """The SDK keyword arguments of the constraint flag given (OSError or ValueError: a file that cannot be
    read, a schema that is not JSON)."""
    if args.json_schema is not None:
        return {"json_schema": json.loads(args.json_schema.read_text())}
    if args.grammar is not None:
        return {"grammar": args.grammar.read_text()}
    given = {"json_object": args.json_object or None, "regex": args.regex, "choice": args.choice}
    return {name: value for name, value in given.items() if value is not None}


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a gateway with TLS or API keys."""
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's roots")
    p.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting these PEM roots")
    p.add_argument("--api-key", help=f"the API key (default: ${API_KEY_ENV})")


def connection_kwargs(args: argparse.Namespace) -> dict:
    """Client's keyword arguments of the connection flags."""
    return {"tls": args.tls, "ca_file": args.tls_ca, "api_key": args.api_key}


def _text_input(args: argparse.Namespace) -> dict:
    """The prompt as generate's keyword arguments: text, a user message, or one with the --image files."""
    if args.image:
        images = [{"type": "image", "image": Path(name).read_bytes()} for name in args.image]
        return {"messages": [{"role": "user", "content": [*images, {"type": "text", "text": args.prompt}]}]}
    return {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}


def run(args: argparse.Namespace) -> int:
    try:
        text_input = _text_input(args)
    except OSError as err:
        print(f"error: cannot read --image {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    targets = ",".join(args.target or [DEFAULT_TARGET])
    try:
        constraint = constraint_kwargs(args)
    except (OSError, ValueError) as err:
        print(f"error: cannot read {args.json_schema or args.grammar}: {err}", file=sys.stderr)
        return 2
    try:
        client = Client(
            targets, timeout=args.timeout, resume_timeout=args.resume_timeout, **connection_kwargs(args)
        )
    except OSError as err:
        print(f"error: cannot read --tls-ca {args.tls_ca}: {err.strerror}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: --target: {err}", file=sys.stderr)
        return 2
    with client:
        try:
            for chunk in client.stream(
                **text_input,
                **sampling_kwargs(args),
                **constraint,
                priority=args.priority,
                sparse_attention=args.sparse_attention,
                chat_template_kwargs=args.chat_template_kwargs,
                lora_adapter=args.lora_adapter,
            ):
                if chunk.reasoning_text:
                    sys.stderr.write(chunk.reasoning_text)
                    sys.stderr.flush()
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                logprobs.extend(chunk.logprobs or ())
                prompt_logprobs.extend(chunk.prompt_logprobs or ())
        except GenerationError as err:
            print(f"\nerror: {err}", file=sys.stderr)
            return 1
    u, t = chunk.usage, chunk.timings
    print()
    for lp in prompt_logprobs:
        alternatives = " ".join(f"{token}:{value:.3f}" for token, value in lp.top)
        print(f"prompt\t{lp.token_id}\t{lp.logprob:.4f}\trank {lp.rank}\t{alternatives}", file=sys.stderr)
    for lp in logprobs:
        alternatives = " ".join(f"{token}:{value:.3f}" for token, value in lp.top)
        print(f"{lp.token_id}\t{lp.logprob:.4f}\t{alternatives}", file=sys.stderr)
    resumed = f"; resumed {chunk.resumes}x" if chunk.resumes else ""
    print(
        f"[{chunk.finish_reason}: {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
        f"{u.completion_tokens} generated; queued {t.queue_s:.3f}s, "
        f"first token {t.time_to_first_token_s:.3f}s, total {t.total_s:.3f}s{resumed}]",
        file=sys.stderr,
    )
    return 0
