"""Greedy streams running through a stop: each in a thread of its own, reporting how it ended."""

import threading

from cli.launch import Stack
from sdk.client import GenerationError


def start_streams(stack: Stack, count: int, new_tokens: int, results: list) -> list[threading.Thread]:
    """`count` greedy streams of `new_tokens`, started; returns once each got its first token. Each appends
    (finish_reason, completion tokens) to `results` when it ends, or (the error's code name, chunks seen)."""
    started = threading.Semaphore(0)
    threads = [
        threading.Thread(target=_stream, args=(stack, seed, new_tokens, started, results))
        for seed in range(count)
    ]
    for thread in threads:
        thread.start()
    assert all(started.acquire(timeout=60) for _ in threads), "every stream runs"
    return threads


def _stream(stack: Stack, seed: int, new_tokens: int, started: threading.Semaphore, results: list) -> None:
    chunks = []
    try:
        with stack.client() as client:
            for chunk in client.stream(token_ids=[3 + seed, 40, 50, 60], max_tokens=new_tokens,
                                       temperature=0.0, ignore_eos=True):  # fmt: skip
                if not chunks:
                    started.release()
                chunks.append(chunk)
        results.append((chunks[-1].finish_reason, chunks[-1].usage.completion_tokens))
    except GenerationError as err:
        results.append((err.code.name, len(chunks)))
