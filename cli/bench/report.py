"""One table for a bench run: pagedserve's figures, the peers' and the ratios."""

ROWS = [
    ("tokens_per_s", "tokens/s (prompt + generated)", "{:.0f}"),
    ("generated_tokens_per_s", "generated tokens/s", "{:.1f}"),
    ("prompt_tokens_per_s", "prompt tokens/s computed", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "{:.0f}"),
    ("itl_p50_ms", "inter-token p50 (ms)", "{:.1f}"),
    ("itl_p99_ms", "inter-token p99 (ms)", "{:.1f}"),
    ("wall_s", "wall time (s)", "{:.1f}"),
    ("cached_prompt_tokens", "prompt tokens from prefix cache", "{:.0f}"),
    ("tier_hit_blocks", "prompt blocks from the KV tier", "{:.0f}"),
    ("tier_load_ms_per_block", "KV tier load per block (ms)", "{:.2f}"),
    ("peak_sequences", "peak sequences in the cache", "{:.0f}"),
    ("peak_used_blocks", "peak KV blocks used", "{:.0f}"),
    ("kv_utilisation_mean", "KV utilisation, time-weighted mean", "{:.1%}"),
    ("kv_utilisation_at_peak", "KV utilisation at peak occupancy", "{:.1%}"),
    ("drafts_kept", "prompt-lookup drafts kept", "{:.1%}"),
    ("prompt_gflop_per_s", "prompt GFLOP/s (cli/bench/roofline.py)", "{:.0f}"),
    ("prompt_fma_share", "prompt GFLOP/s, share of the FMA peak", "{:.0%}"),
    ("decode_gb_per_s", "decode GB/s read (cli/bench/roofline.py)", "{:.1f}"),
    ("decode_read_share", "decode GB/s, share of the read bandwidth", "{:.0%}"),
]
PEERS = ("generate_batch", "generate")
FIRST = "vLLM"  # the engine a user would pick instead: its column comes first
LLAMACPP = "llama.cpp"  # the one for quantised weights: second
# The result's lines on how each peer engine ran, printed under the table's title.
SETUPS = ("vllm_setup", "llamacpp_setup")
PREFIX_CACHE_OFF = "prefix cache off"  # pagedserve itself, on a stack started with --no-prefix-cache


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def ratio(ours, theirs, key: str) -> float | None:
    """pagedserve / peer for rates (per_s) and shares of a ceiling, peer / pagedserve for the rest (times,
    blocks): > 1 means pagedserve is ahead; None when either is missing or zero."""
    if not ours or not theirs:
        return None
    return ours / theirs if key.endswith(("per_s", "_share")) else theirs / ours


def _ratio_cell(ours, theirs, key: str) -> str:
    value = ratio(ours, theirs, key)
    return "-" if value is None else f"{value:.2f}x"


def ratios(result: dict) -> dict:
    """Per peer, the ratio of every figure of the table (None where either side lacks it), as in the table."""
    ours = result["pagedserve"]
    return {
        name: {key: ratio(ours.get(key), theirs.get(key), key) for key, _, _ in ROWS}
        for name, theirs in result.get("peers", {}).items()
    }


def peer_names(peers: dict) -> list[str]:
    """The columns: vLLM first, then llama.cpp, transformers' generate_batch and generate, then the others."""
    known = [name for name in (FIRST, LLAMACPP, *PEERS) if name in peers or name in PEERS]
    return [*known, *(p for p in peers if p not in known)]


def table(result: dict) -> str:
    ours, peers = result["pagedserve"], result.get("peers", {})
    names = peer_names(peers)
    header = ["metric", "pagedserve", *names, *(f"vs {p}" for p in names)]
    lines = [header]
    for key, label, fmt in ROWS:
        row = [label, _cell(ours.get(key), fmt)]
        row += [_cell(peers.get(p, {}).get(key), fmt) for p in names]
        row += [_ratio_cell(ours.get(key), peers.get(p, {}).get(key), key) for p in names]
        lines.append(row)
    setups = [f"({result[key]})" for key in ("setup", *SETUPS) if key in result]
    title = f"{result['workload']}: {result['description']}"
    if "date" in result:
        title += f"\n(measured {result['date']} on {result['machine']})"
    if "ceilings" in result:
        top = result["ceilings"]
        title += (
            f"\n(ceilings: {top['fma_gflop_per_s']:.0f} GFLOP/s float32 FMA, {top['read_gb_per_s']:.1f} GB/s "
            f"read, {top['threads']} threads)"
        )
    return "\n".join([title, *setups, *aligned(lines)])


def aligned(rows: list[list[str]]) -> list[str]:
    """Text lines of a table: the first row a header underlined, the first column left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
