"""The Python SDK: `Client(target).generate(...)` or `.stream(...)`; one client may serve many threads.

Constrained decoding: `json_schema=` (a dict or JSON text), `json_object=True`, `regex=`, `choice=[...]` or
`grammar=` (docs/structured-outputs.md). Tools: `tools=[{"name", "description", "parameters"}]` with chat
`messages`, `tool_choice="auto" | "none" | "required" | "<function name>"`; calls come back as
`Completion.tool_calls` with finish_reason "tool_calls" (docs/tool-calling.md).

`AsyncClient` has the same surface for asyncio (`await generate(...)`, `async for chunk in stream(...)`).

A gateway with TLS: `Client(target, tls=True)` (the system's trusted roots) or `ca_file="ca.pem"`. A gateway
with API keys: `api_key="..."`, or the PAGEDSERVE_API_KEY environment variable.
"""

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.server import CHANNEL_OPTIONS, channel
from protos import generation_pb2, generation_pb2_grpc
from sdk.request import build_request

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class GenerationError(Exception):
    """A refused or failed request; `code` is the gRPC status, `details` says what to change."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability (raw model logits) and the `logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, log-probability), most likely first
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # JSON text
    arguments: str


@dataclass(frozen=True)
class Timings:
    """Seconds from the request's arrival at the gateway: until its first step, its first token, its end."""

    queue_s: float
    time_to_first_token_s: float
    total_s: float


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the new tokens and text; the last one has finish_reason and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # Which of the n samples the chunk continues.
    index: int = 0
    # One per token when the request set logprobs.
    logprobs: list[TokenLogprob] | None = None
    timings: Timings | None = None
    # With tools: the calls this chunk completed.
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: Timings | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def to_chunk(response: generation_pb2.GenerateResponse) -> Chunk:
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
    timings = None
    if response.HasField("timings"):
        t = response.timings
        timings = Timings(t.queue_s, t.time_to_first_token_s, t.total_s)
    return Chunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=usage,
        index=response.index,
        logprobs=[
            TokenLogprob(lp.token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))
            for lp in response.logprobs
        ]
        or None,
        timings=timings,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in response.tool_calls],
    )


API_KEY_ENV = "PAGEDSERVE_API_KEY"


def credentials(tls: bool = False, ca_file: str | Path | None = None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (ca_file's roots, else the system's), None for plaintext (neither given)."""
    if not tls and ca_file is None:
        return None
    roots = Path(ca_file).read_bytes() if ca_file is not None else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def auth_metadata(api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata carrying api_key (else $PAGEDSERVE_API_KEY) as a bearer token; empty without one."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {key}"),) if key else ()


def _error(err: grpc.RpcError) -> GenerationError:
    return GenerationError(err.code(), err.details())


def _add(result: Completion, chunk: Chunk) -> None:
    result.request_id = chunk.request_id
    result.token_ids.extend(chunk.token_ids)
    result.text += chunk.text
    result.tool_calls.extend(chunk.tool_calls)
    result.finish_reason, result.usage, result.timings = chunk.finish_reason, chunk.usage, chunk.timings
    if chunk.logprobs is not None:
        result.logprobs = result.logprobs or []
        result.logprobs.extend(chunk.logprobs)


class Client:
    """Unset sampling fields take the server's defaults (the sampling table of docs/configuration.md).

    The keyword arguments are `build_request`'s: the prompt (prompt, token_ids or messages) and the
    sampling controls of `pagedserve.v1.SamplingParams` (stop may be one string or several). `tls`,
    `ca_file` and `api_key` are for a gateway with TLS or API keys (the module's docstring).
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        timeout: float | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self._channel = channel(target, credentials(tls, ca_file))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = auth_metadata(api_key)
        self.timeout = timeout

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        """Yields chunks as the server produces them; GenerationError on a refused or failed request."""
        call = self._stub.Generate(
            build_request(prompt, **kwargs), timeout=self.timeout, metadata=self._metadata
        )
        try:
            for response in call:
                yield to_chunk(response)
        except grpc.RpcError as err:
            raise _error(err) from None
        finally:
            call.cancel()

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole completion at once: token_ids, text, finish_reason, usage."""
        (result,) = self.generate_n(prompt, n=1, **kwargs)
        return result

    def generate_n(self, prompt: str | None = None, n: int = 1, **kwargs) -> list[Completion]:
        """n samples of one prompt whose KV is computed once; sample i uses seed + i when seeded."""
        results = [Completion() for _ in range(n)]
        for chunk in self.stream(prompt, n=n, **kwargs):
            _add(results[chunk.index], chunk)
        return results

    def info(self) -> generation_pb2.GetInfoResponse:
        try:
            return self._stub.GetInfo(
                generation_pb2.GetInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise _error(err) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio (grpc.aio): the same methods, awaited; create it inside the running event loop.

    `timeout` bounds each whole request; when it passes the request ends with DEADLINE_EXCEEDED.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        timeout: float | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        api_key: str | None = None,
    ) -> None:
        secure = credentials(tls, ca_file)
        if secure is None:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, secure, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = auth_metadata(api_key)
        self.timeout = timeout

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Yields chunks as the server produces them; GenerationError on a refused or failed request."""
        call = self._stub.Generate(
            build_request(prompt, **kwargs), timeout=self.timeout, metadata=self._metadata
        )
        try:
            async for response in call:
                yield to_chunk(response)
        except grpc.RpcError as err:
            raise _error(err) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole completion at once: token_ids, text, finish_reason, usage."""
        (result,) = await self.generate_n(prompt, n=1, **kwargs)
        return result

    async def generate_n(self, prompt: str | None = None, n: int = 1, **kwargs) -> list[Completion]:
        """n samples of one prompt whose KV is computed once; sample i uses seed + i when seeded."""
        results = [Completion() for _ in range(n)]
        async for chunk in self.stream(prompt, n=n, **kwargs):
            _add(results[chunk.index], chunk)
        return results

    async def info(self) -> generation_pb2.GetInfoResponse:
        try:
            return await self._stub.GetInfo(
                generation_pb2.GetInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise _error(err) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
