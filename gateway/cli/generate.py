"""`pagedserve generate TEXT`: stream a completion to stdout."""

import argparse
import sys

from gateway.client import Client, GenerationError


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion from a running stack")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: server's, 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--priority", type=int, default=0, help="lower is served first, equal ones by arrival (default 0)"
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="gateway address HOST:PORT")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text_input = (
        {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    )
    with Client(args.target, timeout=args.timeout) as client:
        try:
            for chunk in client.stream(
                **text_input,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                priority=args.priority,
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except GenerationError as err:
            print(f"\nerror: {err}", file=sys.stderr)
            return 1
    u, t = chunk.usage, chunk.timings
    print()
    print(
        f"[{chunk.finish_reason}: {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
        f"{u.completion_tokens} generated; queued {t.queue_s:.3f}s, "
        f"first token {t.time_to_first_token_s:.3f}s, total {t.total_s:.3f}s]",
        file=sys.stderr,
    )
    return 0
