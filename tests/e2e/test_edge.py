"""The public edge against real processes (a tiny random-weight model): TLS, API keys, one prefix-cache
namespace per key, the request limits, undecodable requests.

One cache and one compute serve two gateways: `edge` (TLS, three keys, small limits, one sequence at a time,
one waiting request, one stream per key) and `shared` (plaintext, the same keys, --shared-prefix-cache,
default limits).

What it guards against: traffic read or sent without TLS or keys; `usage.cached_tokens` telling any caller
whether anyone had sent a prompt; a 50 MB prompt tokenized for minutes, growing the gateway by gigabytes; an
unbounded queue; invalid UTF-8 answered INTERNAL "Exception deserializing request!".
"""

import json
import os
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from cli.scrape import scrape
from common.healthcheck import SERVING, status
from common.server import CHANNEL_OPTIONS
from protos import cache_pb2, compute_pb2, generation_pb2
from sdk.client import API_KEY_ENV, Client, GenerationError, build_request
from tests.certs import self_signed
from tests.helpers import PAGEDSERVE, ROOT, free_port, log_events, log_tail, spawn, start, stop, wait_healthy
from tests.processes import segments_of
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
GENERATION = "pagedserve.v1.Generation"
GRPCURL = str(Path(sys.executable).parent / "grpcurl")
KEYS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef", "carol": "carol-0123456789abcdef"}
MAX_MODEL_LEN = 4096
# The edge gateway's limits (its flags); the shared one keeps the defaults.
LIMITS = {
    "--max-prompt-bytes": 64, "--max-messages": 3, "--max-stop-bytes": 8, "--max-stop-token-ids": 4,
    "--max-logit-bias": 5, "--max-cache-salt-bytes": 10, "--max-request-id-bytes": 12,
    "--max-streams-per-key": 1, "--max-waiting": 1,
}  # fmt: skip
# A refusal comes within this many seconds: far below the work it saves (tokenizing 50 MB takes minutes),
# far above the 0.15 s it takes on an idle machine (most of it the client sending), so a loaded CI host
# cannot fail it. A huge prompt's refusal (the median of three calls) grows the gateway's RSS by less than
# HUGE_PROMPT_RSS.
REFUSED_S, HUGE_PROMPT_RSS = 5.0, 64 * 2**20
GREEDY = dict(temperature=0.0, max_tokens=1)
# The served model's name (its directory's).
TINY = "tiny"


class Edge:
    """The processes of the module, their targets, the TLS files."""

    def __init__(self, tmp: Path, logs: Path) -> None:
        self.tmp, self.logs, self.procs, self.targets = tmp, logs, {}, {}
        self.cert, self.key = self_signed(tmp)
        self.keys_file = tmp / "api-keys"
        self.keys_file.write_text("# tenants\n" + "".join(f"{n}:{k}\n" for n, k in KEYS.items()))
        self.keys_file.chmod(0o600)

    def start(self, name: str, module: str, *args: str, wait=True) -> str:
        port = free_port()
        proc = start(module, "--port", str(port), *args, log_path=self.logs / f"{name}.log")
        self.procs[name] = proc
        target = self.targets[name] = f"127.0.0.1:{port}"
        if wait:
            wait_healthy(target, proc, 120)
        return target

    def writable_keys(self) -> Path:
        """A copy of the key file that anyone may write."""
        path = self.tmp / "writable-keys"
        path.write_text(self.keys_file.read_text())
        path.chmod(0o666)
        return path

    def tls(self) -> dict:
        return {"credentials": grpc.ssl_channel_credentials(self.cert.read_bytes())}

    def client(self, target: str, key: str | None = "alice", **kwargs) -> Client:
        return Client(target, timeout=60, api_key=KEYS.get(key, key), **kwargs)

    def edge_client(self, key: str | None = "alice") -> Client:
        return self.client(self.edge, key, ca_file=self.cert)

    def openai(self, key: str = "alice", scheme: str = "https", port: int = 0) -> openai.OpenAI:
        """The official OpenAI client of the edge gateway's HTTP API (or that on `port`), trusting its
        certificate."""
        return openai.OpenAI(
            base_url=f"{scheme}://127.0.0.1:{port or self.http}/v1",
            api_key=KEYS.get(key, key),
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=self.cert)),
        )


def _wait_tls(target: str, proc, tls: dict, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while status(target, GENERATION, **tls) != SERVING:
        assert proc.poll() is None and time.monotonic() < deadline, f"{target} did not come up"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def edge(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("edge")
    model = save_tiny_llama(
        tmp / "tiny", initializer_range=0.3, max_position_embeddings=MAX_MODEL_LEN, vocab_size=len(tokenizer)
    )
    tokenizer.save_pretrained(model)
    svc = Edge(tmp, tmp_path_factory.mktemp("logs"))
    try:
        cache = svc.start("cache", "cache_service", "--kv-blocks", "400", "--insecure")
        compute = svc.start(
            "compute", "compute_service", "--model", str(model), "--dtype", "float32", "--insecure"
        )
        common = ["--model", str(model), "--cache-target", cache, "--compute-target", compute,
                  "--api-keys", str(svc.keys_file), "--log-format", "json"]  # fmt: skip
        svc.metrics = free_port()
        limits = [str(arg) for item in LIMITS.items() for arg in item]
        tls = ["--tls-cert", str(svc.cert), "--tls-key", str(svc.key)]
        svc.http = free_port()
        svc.edge = svc.start("edge", "gateway", *common, *tls, "--max-seqs", "1",
                             "--http-port", str(svc.http), "--metrics-port", str(svc.metrics), *limits,
                             wait=False)  # fmt: skip
        _wait_tls(svc.edge, svc.procs["edge"], svc.tls())
        svc.shared = svc.start("shared", "gateway", *common, "--shared-prefix-cache")
        svc.model = model
        yield svc
    finally:
        codes = {name: stop(proc) for name, proc in reversed(svc.procs.items())}
        assert set(codes.values()) <= {0}, codes
        assert "cache" not in svc.procs or not segments_of(svc.procs["cache"].pid)


def refused(call, code: grpc.StatusCode) -> tuple[str, float]:
    """The details of the refusal `call()` raises, and how long it took."""
    began = time.monotonic()
    with pytest.raises(GenerationError) as err:
        call()
    assert err.value.code == code, err.value
    return err.value.details, time.monotonic() - began


# TLS
def test_the_edge_speaks_only_tls_with_a_certificate_the_client_trusts(edge):
    # NOTE: resume_timeout 0: a handshake that fails is UNAVAILABLE, which the SDK would otherwise retry.
    with edge.client(edge.edge, resume_timeout=0) as plaintext:
        refused(lambda: plaintext.generate(token_ids=[5, 6], **GREEDY), grpc.StatusCode.UNAVAILABLE)
    with edge.client(edge.edge, tls=True, resume_timeout=0) as system_roots:
        refused(lambda: system_roots.generate(token_ids=[5, 6], **GREEDY), grpc.StatusCode.UNAVAILABLE)
    with edge.edge_client() as trusted:
        assert trusted.info().max_model_len == MAX_MODEL_LEN
        assert len(trusted.generate(token_ids=[5, 6], **GREEDY).token_ids) == 1


def test_pagedserve_up_serves_tls_and_reports_ready(edge):
    """`up` forwards --tls-cert/--tls-key and its readiness probe speaks TLS to the gateway."""
    port, http = free_port(), free_port()
    argv = [*PAGEDSERVE, "up", "--model", str(edge.model), "--dtype", "float32", "--kv-blocks", "64",
            "--port", str(port), "--http-port", str(http),
            "--tls-cert", str(edge.cert), "--tls-key", str(edge.key),
            "--api-keys", str(edge.keys_file)]  # fmt: skip
    up = spawn(argv, edge.logs / "up.log")
    try:
        deadline = time.monotonic() + 120
        while "pagedserve ready" not in Path(up.log_path).read_text():
            assert up.poll() is None and time.monotonic() < deadline, log_tail(up)
            time.sleep(0.2)
        with edge.client(f"127.0.0.1:{port}", "carol", ca_file=edge.cert) as client:
            assert len(client.generate(token_ids=[5, 6], **GREEDY).token_ids) == 1
        assert f"OpenAI-compatible API on https://127.0.0.1:{http}/v1" in Path(up.log_path).read_text()
        with edge.openai("carol", port=http) as api:
            assert [card.id for card in api.models.list().data] == [TINY]
    finally:
        assert stop(up, 60) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (lambda e: ["--tls-cert", str(e.cert)], "--tls-cert and --tls-key go together"),
        (
            lambda e: ["--tls-cert", str(e.cert), "--tls-key", str(e.keys_file)],
            "not an unencrypted PEM private key",
        ),
        (lambda e: ["--api-keys", str(e.cert)], "line 1 (line-1): a key must be at least 16 characters"),
        (
            lambda e: ["--api-keys", str(e.writable_keys())],
            "others can write the key file (mode 666): chmod 600",
        ),
    ],
    ids=["cert-without-key", "key-not-pem", "bad-key-line", "writable-key-file"],
)
def test_the_gateway_exits_at_start_on_unusable_tls_or_key_files(edge, flags, message):
    out = subprocess.run([sys.executable, "-m", "gateway", "--port", str(free_port()), *flags(edge)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode != 0 and message in out.stderr, out.stderr


# API keys
def test_without_a_known_key_generate_and_info_are_unauthenticated(edge):
    for key in (None, "not-a-configured-key-at-all", KEYS["alice"] + "x"):
        with edge.edge_client(key) as client:
            details, _ = refused(
                lambda c=client: c.generate(prompt="hi", **GREEDY), grpc.StatusCode.UNAUTHENTICATED
            )
            assert "authorization: Bearer <key>" in details
            refused(client.info, grpc.StatusCode.UNAUTHENTICATED)
    with edge.edge_client("bob") as client:
        assert len(client.generate(prompt="hi", **GREEDY).token_ids) == 1


def test_health_and_reflection_stay_open_and_keys_never_reach_the_log(edge):
    assert status(edge.edge, GENERATION, **edge.tls()) == SERVING
    listed = subprocess.run([GRPCURL, "-cacert", str(edge.cert), edge.edge, "list"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert GENERATION in listed.stdout.split(), listed.stderr
    log = Path(edge.procs["edge"].log_path)
    names = {event.get("api_key") for event in log_events(log) if event["event"] == "request"}
    assert {"alice", "bob"} <= names
    assert not any(key in log.read_text() for key in KEYS.values())


def test_grpcurl_with_tls_and_a_bearer_key(edge):
    body = {"token_ids": [5, 6, 7], "sampling": {"max_tokens": 2, "temperature": 0}}
    out = subprocess.run(
        [GRPCURL, "-cacert", str(edge.cert), "-H", f"authorization: Bearer {KEYS['carol']}",
         "-d", json.dumps(body), edge.edge, f"{GENERATION}/Generate"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "FINISH_REASON_LENGTH"' in out.stdout


def test_the_cli_takes_the_ca_and_the_key_from_the_environment(edge):
    argv = [
        *PAGEDSERVE,
        "generate",
        "hi",
        "--max-tokens",
        "2",
        "--target",
        edge.edge,
        "--tls-ca",
        str(edge.cert),
    ]
    run = lambda env: subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)  # noqa: E731
    base = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    ok = run({**base, API_KEY_ENV: KEYS["alice"]})
    assert ok.returncode == 0 and "2 generated" in ok.stderr, ok.stderr
    denied = run(base)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr


# prefix-cache namespaces
PROMPT = list(range(10, 58))  # 48 tokens: 3 full blocks of 16


def cached(client: Client, prompt: list[int]) -> int:
    return client.generate(token_ids=prompt, **GREEDY).usage.cached_tokens


def test_each_key_has_its_own_prefix_cache_namespace(edge):
    """Bob sends the prompt Alice sent: he sees no cached token, so cached_tokens tells him nothing."""
    with edge.edge_client("alice") as alice, edge.edge_client("bob") as bob:
        assert cached(alice, PROMPT) == 0
        assert cached(bob, PROMPT) == 0
        assert cached(alice, PROMPT) == len(PROMPT) - 1
        assert cached(bob, PROMPT) == len(PROMPT) - 1


def http_cached(api: openai.OpenAI, prompt: list[int]) -> int:
    reply = api.completions.create(model=TINY, prompt=prompt, temperature=0, max_tokens=1)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_the_http_api_speaks_only_tls_and_needs_a_known_key(edge):
    for key in ("not-a-configured-key-at-all", KEYS["alice"] + "x"):
        with edge.openai(key) as api, pytest.raises(openai.AuthenticationError) as caught:
            api.models.list()
        assert caught.value.status_code == 401 and "authorization: Bearer <key>" in caught.value.message
    keyless = subprocess.run(["curl", "-sS", "--cacert", str(edge.cert), f"https://127.0.0.1:{edge.http}/v1/models"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert json.loads(keyless.stdout)["error"]["type"] == "authentication_error"
    with edge.openai("alice", scheme="http") as plaintext, pytest.raises(openai.APIConnectionError):
        plaintext.models.list()
    health = subprocess.run(["curl", "-sS", "--cacert", str(edge.cert), f"https://127.0.0.1:{edge.http}/health"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert json.loads(health.stdout) == {"status": "serving"}, "health stays open"
    with edge.openai("carol") as api:
        assert [card.id for card in api.models.list().data] == [TINY]
        reply = api.completions.create(model=TINY, prompt=[5, 6], temperature=0, max_tokens=2)
        assert reply.usage.completion_tokens == 2 and reply.choices[0].finish_reason == "length"


def test_http_and_grpc_requests_of_a_key_share_its_namespace_only(edge):
    """Alice's gRPC prompt is cached for her HTTP requests, never for Bob's."""
    prompt = [p + 200 for p in PROMPT]
    with edge.edge_client("alice") as alice, edge.openai("alice") as alice_http, edge.openai("bob") as bob:
        assert cached(alice, prompt) == 0
        assert http_cached(alice_http, prompt) == len(prompt) - 1
        assert http_cached(bob, prompt) == 0


def test_the_http_api_takes_the_edge_limits(edge):
    with edge.openai("alice") as api:
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model=TINY, prompt="x" * 65, max_tokens=1)
        assert (
            caught.value.param == "prompt" and "the limit is 64 (--max-prompt-bytes)" in caught.value.message
        )
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model=TINY, prompt=[5], stop=["123456789"], max_tokens=1)
        assert caught.value.param == "stop" and "(--max-stop-bytes)" in caught.value.message
        with edge.edge_client("alice") as alice:
            long = alice.stream(token_ids=[5, 6, 7], temperature=0.0, max_tokens=4000, ignore_eos=True)
            next(long)
            with pytest.raises(openai.RateLimitError) as caught:
                api.completions.create(model=TINY, prompt=[5], max_tokens=1)
            assert caught.value.status_code == 429 and "(--max-streams-per-key)" in caught.value.message
            long.close()


def test_a_shared_prefix_cache_shares_blocks_across_keys(edge):
    prompt = [p + 100 for p in PROMPT]
    with edge.client(edge.shared, "alice") as alice, edge.client(edge.shared, "bob") as bob:
        assert cached(alice, prompt) == 0
        assert cached(bob, prompt) == len(PROMPT) - 1


# limits
# (the field, its value at the edge gateway's limit, one past it, the refusal's text); the prompt is "hi"
# unless the field replaces it.
USER = {"role": "user", "content": "x"}
EDGES = [
    ("prompt", "p" * 64, "p" * 65, "prompt has at least 65 bytes; the limit is 64 (--max-prompt-bytes)"),
    ("messages", [USER] * 3, [USER] * 4, "messages has 4 entries; the limit is 3 (--max-messages)"),
    ("stop", "s" * 8, "s" * 9, "the limit is 8 (--max-stop-bytes)"),
    ("stop", ["s"] * 16, ["s"] * 17, "at most 16 non-empty strings"),
    ("stop_token_ids", [1] * 4, [1] * 5, "the limit is 4 (--max-stop-token-ids)"),
    ("logit_bias", dict.fromkeys(range(5), 1.0), dict.fromkeys(range(6), 1.0), "(--max-logit-bias)"),
    ("cache_salt", "s" * 10, "s" * 11, "the limit is 10 (--max-cache-salt-bytes)"),
    ("request_id", "r" * 12, "r" * 13, "the limit is 12 (--max-request-id-bytes)"),
    ("token_ids", [5] * (MAX_MODEL_LEN - 1), [5] * MAX_MODEL_LEN, "the model takes at most 4095"),
]


def with_field(field: str, value) -> dict:
    prompt = {} if field in ("prompt", "messages", "token_ids") else {"prompt": "hi"}
    return {**prompt, field: value, **GREEDY}


@pytest.mark.parametrize(
    ("field", "at", "past", "message"), EDGES, ids=[f"{e[0]}-{len(e[1])}" for e in EDGES]
)
def test_each_limit_takes_its_edge_and_refuses_one_past_at_once(edge, field, at, past, message):
    with edge.edge_client() as client:
        assert client.generate(**with_field(field, at)).finish_reason is not None
        too_much = with_field(field, past)
        details, seconds = refused(lambda: client.generate(**too_much), grpc.StatusCode.INVALID_ARGUMENT)
    assert message in details and seconds < REFUSED_S


def rss(pid: int) -> int:
    line = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS")
    )
    return int(line.split()[1]) * 1024


def raw_generate(target: str, request: bytes, *metadata: tuple[str, str]) -> grpc.RpcError:
    """The error of Bob's Generate whose request is already serialized (so only the call is timed)."""
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream(f"/{GENERATION}/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(call(request, timeout=60, metadata=(("authorization", f"Bearer {KEYS['bob']}"), *metadata)))
    return err.value


def test_a_request_id_in_metadata_takes_the_limit_too(edge):
    request = build_request("hi", max_tokens=1).SerializeToString()
    err = raw_generate(edge.shared, request, ("x-request-id", "r" * 129))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id has at least 129 bytes; the limit is 128 (--max-request-id-bytes)" in err.details()
    with edge.client(edge.shared, "bob") as client:
        assert client.generate(prompt="hi", request_id="r" * 128, **GREEDY).request_id == "r" * 128


@pytest.mark.parametrize(
    ("megabytes", "code", "message"),
    [
        (50, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        (4, grpc.StatusCode.INVALID_ARGUMENT, "the limit is 131072 (--max-prompt-bytes)"),
    ],
)
def test_a_huge_prompt_is_refused_at_once_leaving_the_gateway_its_size(edge, megabytes, code, message):
    """At the default limits: 50 MB is over --max-request-bytes (8 MiB), so gRPC refuses it unread; 4 MB is
    over --max-prompt-bytes (32 bytes x 4096 tokens = 128 KiB), refused before tokenizing. Each within
    REFUSED_S (the median of three calls), the gateway's RSS growing by less than HUGE_PROMPT_RSS."""
    pid = edge.procs["shared"].pid
    request = build_request("word " * (megabytes * 200_000), max_tokens=1).SerializeToString()
    before, seconds = rss(pid), []
    for _ in range(3):
        began = time.monotonic()
        err = raw_generate(edge.shared, request)
        seconds.append(time.monotonic() - began)
        assert err.code() == code and message in err.details(), err
    assert sorted(seconds)[1] < REFUSED_S, seconds
    assert rss(pid) - before < HUGE_PROMPT_RSS, (before, rss(pid))


def waiting(edge) -> float:
    return scrape(f"http://127.0.0.1:{edge.metrics}/metrics")[("pagedserve_requests_waiting", ())]


def test_streams_per_key_and_the_queue_are_capped_while_others_complete(edge):
    """The edge runs one sequence at a time and queues one: Alice's long stream runs, her second stream is
    refused (--max-streams-per-key 1), Bob's request waits, Carol's finds the queue full (--max-waiting 1);
    once Alice's stream ends Bob's completes, and so does Carol's retry."""
    with edge.edge_client("alice") as alice, ThreadPoolExecutor(1) as pool:
        long = alice.stream(token_ids=[5, 6, 7], temperature=0.0, max_tokens=4000, ignore_eos=True)
        next(long)
        details, seconds = refused(
            lambda: alice.generate(prompt="hi", **GREEDY), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "'alice' has 1 streams open; the limit is 1 (--max-streams-per-key)" in details
        assert seconds < REFUSED_S
        bob = pool.submit(
            lambda: edge.edge_client("bob").generate(token_ids=[8, 9], max_tokens=4, temperature=0.0)
        )
        deadline = time.monotonic() + 30
        while waiting(edge) < 1:
            assert time.monotonic() < deadline and not bob.done(), "Bob's request never queued"
            time.sleep(0.05)
        with edge.edge_client("carol") as carol:
            details, seconds = refused(
                lambda: carol.generate(prompt="hi", **GREEDY), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            assert "queue is full" in details and "the limit is 1 (--max-waiting)" in details
            assert seconds < REFUSED_S
            long.close()
            assert len(bob.result(timeout=60).token_ids) == 4
            assert len(carol.generate(prompt="hi", **GREEDY).token_ids) == 1


def bad_utf8(message) -> bytes:
    """message serialized with its first string field, set to "h~" beforehand, holding the byte 0xff."""
    data = message.SerializeToString()
    assert data.count(b"h~") == 1
    return data.replace(b"h~", b"h\xff")


@pytest.mark.parametrize(
    ("gateway_or_peer", "method", "message", "stream"),
    [
        ("shared", f"/{GENERATION}/Generate", generation_pb2.GenerateRequest(prompt="h~"), True),
        ("cache", "/pagedserve.v1.Cache/RenewSession", cache_pb2.RenewSessionRequest(session_id="h~"), False),
        ("compute", "/pagedserve.v1.Compute/Forward", compute_pb2.ForwardRequest(pool_epoch="h~"), False),
    ],
)
def test_invalid_utf8_is_an_invalid_argument_on_every_service(edge, gateway_or_peer, method, message, stream):
    target = {"shared": edge.shared, "cache": edge.targets["cache"], "compute": edge.targets["compute"]}[
        gateway_or_peer
    ]
    with grpc.insecure_channel(target) as channel:
        call = (channel.unary_stream if stream else channel.unary_unary)(method)
        with pytest.raises(grpc.RpcError) as err:
            reply = call(
                bad_utf8(message), timeout=10, metadata=(("authorization", f"Bearer {KEYS['bob']}"),)
            )
            list(reply) if stream else reply
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "String field had bad UTF-8" in err.value.details()
    assert status(target) == SERVING
