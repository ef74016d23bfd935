"""`pagedserve generate TEXT`: stream a completion to stdout."""

import argparse
import sys

from sdk.client import Client, GenerationError, TokenLogprob


def _bias(value: str) -> tuple[int, float]:
    token, _, bias = value.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS such as 42=-100, got {value!r}") from None


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion from a running stack")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS, stop token or stop string before this")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: server's, 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=None, help="keep tokens with p >= MIN_P * max p")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats (HF)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI)")
    p.add_argument("--logit-bias", type=_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS in [-100, 100] to a token's logit (repeatable)")  # fmt: skip
    p.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop at this token")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's logprob and its N most likely alternatives (stderr)")  # fmt: skip
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
    logprobs: list[TokenLogprob] = []
    with Client(args.target, timeout=args.timeout) as client:
        try:
            for chunk in client.stream(
                **text_input,
                max_tokens=args.max_tokens,
                min_tokens=args.min_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                min_p=args.min_p,
                repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                logit_bias=dict(args.logit_bias),
                stop=args.stop,
                stop_token_ids=args.stop_token_id,
                logprobs=args.logprobs,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                priority=args.priority,
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                logprobs.extend(chunk.logprobs or ())
        except GenerationError as err:
            print(f"\nerror: {err}", file=sys.stderr)
            return 1
    u, t = chunk.usage, chunk.timings
    print()
    for lp in logprobs:
        alternatives = " ".join(f"{token}:{value:.3f}" for token, value in lp.top)
        print(f"{lp.token_id}\t{lp.logprob:.4f}\t{alternatives}", file=sys.stderr)
    print(
        f"[{chunk.finish_reason}: {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
        f"{u.completion_tokens} generated; queued {t.queue_s:.3f}s, "
        f"first token {t.time_to_first_token_s:.3f}s, total {t.total_s:.3f}s]",
        file=sys.stderr,
    )
    return 0
