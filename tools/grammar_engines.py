"""Grammar engines compared on this machine (the choice in docs/structured-outputs.md): for each schema of
tools/structured_samples.py, the compile time and the per-token mask time of llguidance, xgrammar and
outlines-core with the served model's tokenizer, walking a valid instance token by token.

llguidance is the project's dependency; the other two are installed only to rerun the comparison:

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=$PWD .venv/bin/python tools/grammar_engines.py --model smollm2
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from transformers import AutoTokenizer

from common.model_files import local_copy
from tools.structured_samples import SAMPLES, Sample


def _llguidance(tokenizer, vocab: int) -> Callable:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_(sample: Sample):
        kind, spec = sample.kind, sample.spec
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

        def step(token: int | None) -> bool:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            if token is None:
                return True
            allowed = bool(mask[0, token // 32] >> (token % 32) & 1)
            return allowed and matcher.consume_token(token)

        return step

    return compile_


def _xgrammar(tokenizer, vocab: int) -> Callable:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_(sample: Sample):
        kind, spec = sample.kind, sample.spec
        if kind == "json":
            compiled = compiler.compile_json_schema(spec)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_grammar(xgrammar.Grammar.from_ebnf(spec))
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab)

        def step(token: int | None) -> bool:
            matcher.fill_next_token_bitmask(mask)
            if token is None:
                return True
            allowed = bool(int(mask[0, token // 32]) >> (token % 32) & 1)
            return allowed and matcher.accept_token(token)

        return step

    return compile_


def _outlines(tokenizer, vocab: int) -> Callable:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    tokens: dict[bytes, list[int]] = {}
    special = set(tokenizer.all_special_ids)
    for text, token in tokenizer.get_vocab().items():
        if token not in special and token < vocab:
            tokens.setdefault(bytes(byte_of.get(c, 0) for c in text), []).append(token)
    vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)

    def compile_(sample: Sample):
        if sample.kind not in ("json", "regex"):
            return None
        regex = build_regex_from_schema(sample.spec) if sample.kind == "json" else sample.spec
        guide = Guide(Index(regex, vocabulary))
        mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

        def step(token: int | None) -> bool:
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            if token is None:
                return True
            allowed = bool(int(mask[token // 32]) >> (token % 32) & 1)
            return allowed and (guide.advance(token) is not None)

        return step

    return compile_


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: which character stands for each byte in a byte-level BPE vocabulary."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def measure(make: Callable, sample: Sample, ids: list[int], repeats: int) -> dict | None:
    compiles = []
    for _ in range(repeats):
        start = time.perf_counter()
        step = make(sample)
        compiles.append(time.perf_counter() - start)
    if step is None:
        return None
    masks = []
    for token in [*ids, None]:
        start = time.perf_counter()
        ok = step(token)
        masks.append(time.perf_counter() - start)
        assert ok, f"{sample.name}: token {token} refused"
    return {
        "compile_ms": round(statistics.median(compiles) * 1e3, 2),
        "mask_us_mean": round(statistics.mean(masks) * 1e6, 1),
        "mask_us_p99": round(sorted(masks)[int(0.99 * (len(masks) - 1))] * 1e6, 1),
        "tokens": len(ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engines", nargs="*", default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3, help="compiles per schema (median kept)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(local_copy(args.model).path)
    vocab = len(tokenizer)
    results: dict[str, dict] = {}
    for engine in args.engines:
        start = time.perf_counter()
        make = ENGINES[engine](tokenizer, vocab)
        results[engine] = {"tokenizer_ms": round((time.perf_counter() - start) * 1e3, 1)}
        for sample in SAMPLES:
            ids = tokenizer.encode(sample.instance, add_special_tokens=False)
            results[engine][sample.name] = measure(make, sample, ids, args.repeats)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
