"""TTFT of a repeated image just after compute restarts, with the cache service's image store
(docs/vision.md#image-store) and without it (--image-store-memory 0), through `pagedserve up` and the
OpenAI API: a LLaVA of a CLIP-B/16-like tower (224 px, 196 image tokens, 6 layers of width 384) and the
tests' tiny Llama text model, in float32.

Per variant, one stack: an image is sent once (stored where a store is); then, `--restarts` times, compute
is SIGKILLed, `up` restarts it, a text-only request waits out the gateway's reconnection, and the same image
is sent after a preamble text no earlier request had (so the prefix cache, which survives compute too,
holds nothing past it), then a new image likewise. Prints the median TTFT of each and writes them with
--json.

    PYTHONPATH=$PWD .venv/bin/python tools/image_store_ttft.py --json docs/measurements/image-store-ttft.json
"""

import argparse
import base64
import json
import os
import signal
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import openai

from cli.launch import Stack
from cli.processes import services_of
from cli.scrape import scrape
from common.cpu import describe
from common.model_files import local_copy
from tests.vision_model import png, save_tiny_llava

MODEL = "llava-b16"
TOWER = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 6}
VARIANTS = {"image store (128 MiB, the default)": "128MiB", "no image store": "0"}


def message(preamble: str, image: bytes | None) -> list[dict]:
    parts = [{"type": "text", "text": preamble}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]


def ttft(api: openai.OpenAI, messages: list[dict]) -> float:
    """Seconds to the first streamed token."""
    start = time.perf_counter()
    stream = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0.0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - start
    return first


def restart_compute(stack: Stack) -> None:
    old = services_of(stack.proc.pid)["compute"]
    os.kill(old, signal.SIGKILL)
    while services_of(stack.proc.pid).get("compute", old) == old:
        time.sleep(0.1)


def run_variant(path: Path, memory: str, restarts: int, logs: Path) -> dict:
    flags = ("--model", str(path), "--dtype", "float32", "--image-store-memory", memory)
    # the text-only request after a restart waits for compute however long its start takes
    flags += ("--peer-restart-grace", "600")
    stack = Stack.start(*flags, log_dir=logs, timeout=600)
    repeated, new = [], []
    try:
        with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=600) as api:
            image = png(0, (300, 240))
            ttft(api, message("First.", image))
            for i in range(restarts):
                restart_compute(stack)
                ttft(api, message(f"Text {i}.", None))
                repeated.append(ttft(api, message(f"Again {i}.", image)))
                new.append(ttft(api, message(f"New {i}.", png(100 + i, (300, 240)))))
            metrics = scrape(stack.metrics_url("cache"))
            hits = metrics.get(("pagedserve_image_store_hits_total", ()), 0.0)
    finally:
        stack.stop()
    return {
        "repeated_image_ttft_ms": [round(s * 1e3, 1) for s in repeated],
        "repeated_image_ttft_ms_median": round(statistics.median(repeated) * 1e3, 1),
        "new_image_ttft_ms_median": round(statistics.median(new) * 1e3, 1),
        "image_store_hits": hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = save_tiny_llava(
            Path(root) / MODEL, local_copy("smollm2").path, image_size=224, patch=16, **TOWER
        )
        results = {
            name: run_variant(path, memory, args.restarts, Path(root)) for name, memory in VARIANTS.items()
        }
    for name, figures in results.items():
        repeated, new = figures["repeated_image_ttft_ms_median"], figures["new_image_ttft_ms_median"]
        print(
            f"{name:<36} repeated image after a compute restart {repeated:7.1f} ms   new image {new:7.1f} ms"
        )
    if args.json:
        record = {
            "machine": describe(),
            "date": date.today().isoformat(),
            "model": f"LLaVA-1.5: CLIP tower {TOWER}, 224 px, patch 16 (196 image tokens); tiny Llama text",
            "dtype": "float32",
            "image": "300x240 PNG",
            "restarts": args.restarts,
            "variants": results,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
