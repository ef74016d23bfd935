"""An HTTP server that speaks llama.cpp's `llama-server` protocol as the bench uses it, for the llama.cpp
peer's tests: run as `python tests/llamacpp_protocol_server.py` with llama-server's flags.

It answers `--version`, `GET /health` (503 while it "loads", then 200) and streamed `POST /v1/completions`
on token-id prompts the way llama-server does: one server-sent event per token with `timings.predicted_n`
(the tokens so far; every fourth token is held back and sent with the next, as llama-server holds a token
that ends inside a UTF-8 character), then a last event with the usage and `cache_n`, then `[DONE]`. It
generates greedily by a fixed rule (the next id is the last one + 1), a token every STEP_S, after
PROMPT_S_PER_TOKEN for each prompt token it has not seen as a prefix of an earlier prompt (its prompt cache).

Each request's body goes as one JSON line to $LLAMACPP_TEST_RECORD (with the server's port and argv), so a
test can check what the bench sent; $LLAMACPP_TEST_EXIT makes it exit at start with that status, and
$LLAMACPP_TEST_FAIL_AFTER breaks a stream off with an error event after that many tokens.
"""

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STEP_S = 0.02
PROMPT_S_PER_TOKEN = 0.0002
LOAD_S = 0.3
VERSION = "version: 1 (protocol test server)"


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ready_at = time.monotonic() + LOAD_S
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    def cached(self, prompt: list[int]) -> int:
        """The longest common prefix with an earlier prompt (then this prompt is remembered)."""
        with self.lock:
            best = 0
            for seen in self.prompts:
                n = 0
                while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
                    n += 1
                best = max(best, n)
            self.prompts.append(prompt)
            return best


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        ready = time.monotonic() >= self.state.ready_at
        self._json(200 if ready else 503, {"status": "ok"} if ready else {"error": "Loading model"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        record = os.environ.get("LLAMACPP_TEST_RECORD")
        if record:
            with open(record, "a") as out:
                line = {"port": self.server.server_port, "argv": sys.argv[1:], "body": body}
                out.write(json.dumps(line) + "\n")
        prompt = body.get("prompt")
        if self.path != "/v1/completions" or not isinstance(prompt, list) or not prompt:
            self._json(400, {"error": {"code": 400, "message": "prompt must be a list of token ids"}})
            return
        if not (body.get("stream") and body.get("timings_per_token")):
            self._json(400, {"error": {"code": 400, "message": "this server only streams with timings"}})
            return
        self._stream(prompt, body["max_tokens"])

    def _stream(self, prompt: list[int], max_tokens: int) -> None:
        cached = self.state.cached(prompt)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(PROMPT_S_PER_TOKEN * (len(prompt) - cached))
        fail_after = int(os.environ.get("LLAMACPP_TEST_FAIL_AFTER", "-1"))
        for n in range(1, max_tokens + 1):
            time.sleep(STEP_S)
            if n == fail_after:
                self._event({"error": {"code": 500, "message": "decode failed"}})
                break
            if n % 4 == 2 and n < max_tokens:
                continue  # held back: sent with the next token
            token = prompt[-1] + n
            timings = {"predicted_n": n, "cache_n": cached, "prompt_n": len(prompt) - cached}
            self._event({"choices": [{"text": f" t{token}", "index": 0, "logprobs": None,
                                      "finish_reason": None}], "object": "text_completion",
                         "timings": timings})  # fmt: skip
        else:
            usage = {"completion_tokens": max_tokens, "prompt_tokens": len(prompt),
                     "total_tokens": max_tokens + len(prompt),
                     "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
            timings = {"predicted_n": max_tokens, "cache_n": cached, "prompt_n": len(prompt) - cached}
            self._event({"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                         "object": "text_completion", "usage": usage, "timings": timings})  # fmt: skip
        self._write(b"data: [DONE]\n\n")
        self._write(b"")

    def _event(self, data: dict) -> None:
        self._write(f"data: {json.dumps(data)}\n\n".encode())

    def _write(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def install(directory: Path) -> Path:
    """An executable `llama-server` in directory that runs this server with whatever flags it is given."""
    path = directory / "llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    path.chmod(0o755)
    return path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", action="store_true")
    for flag in ("--model", "--host", "--port", "--threads", "--threads-batch", "--parallel", "--ctx-size"):
        parser.add_argument(flag)
    for flag in ("--kv-unified", "--cont-batching", "--no-webui", "--no-repack"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args()
    if args.version:
        print(VERSION, file=sys.stderr)
        return 0
    if os.environ.get("LLAMACPP_TEST_EXIT"):
        print("error: failed to load model", file=sys.stderr)
        return int(os.environ["LLAMACPP_TEST_EXIT"])
    Handler.state = State(args)
    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)
    server.daemon_threads = True
    print(f"listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
