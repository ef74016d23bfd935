"""The Python SDK: `Client(target).generate(...)` or `.stream(...)`; one client may serve many threads. Given
several gateways, or one that `pagedserve up` restarts, a broken stream resumes where it broke (sdk.resume).

Constrained decoding: `json_schema=` (a dict or JSON text), `json_object=True`, `regex=`, `choice=[...]` or
`grammar=` (docs/structured-outputs.md). Tools: `tools=[{"name", "description", "parameters"}]` with chat
`messages`, `tool_choice="auto" | "none" | "required" | "<function name>"`; calls come back as
`Completion.tool_calls` with finish_reason "tool_calls" (docs/tool-calling.md).

Embeddings: `embed("text")` or `embed(["a", "b"], dimensions=256, lora_adapter="sql")` returns `Embeddings`
(one vector per input; docs/embeddings.md); `score("query", ["doc", ...])` returns `Scores` (a scoring
model's).

`AsyncClient` has the same surface for asyncio (`await generate(...)`, `async for chunk in stream(...)`).

A gateway with TLS: `Client(target, tls=True)` (the system's trusted roots) or `ca_file="ca.pem"`. A gateway
with API keys: `api_key="..."`, or the PAGEDSERVE_API_KEY environment variable.
"""

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc

from common.server import CHANNEL_OPTIONS, channel
from protos import generation_pb2, generation_pb2_grpc
from sdk.embeddings import (
    Embeddings,
    EmbedUsage,
    Inputs,
    Scores,
    embed_request,
    score_request,
    to_embeddings,
    to_scores,
)
from sdk.messages import Chunk, Completion, TokenLogprob, ToolCall, Usage, add, to_chunk
from sdk.request import build_request, tokenize_request
from sdk.resume import RECONNECT_OPTIONS, RESUME_TIMEOUT_S, Call, Targets, target_list

__all__ = [
    "API_KEY_ENV", "AsyncClient", "Chunk", "Client", "Completion", "EmbedUsage", "Embeddings", "Scores",
    "GenerationError", "TokenLogprob", "ToolCall", "Usage", "build_request",
]  # fmt: skip


class GenerationError(Exception):
    """A refused or failed request; `code` is the gRPC status, `details` says what to change."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


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


def _after_break(call: Call, err: grpc.RpcError) -> float:
    """After an attempt broke with err: the seconds to wait before the next one (0 when it broke after the
    last response: nothing is missing, the loop ends); GenerationError when it is not to be resumed."""
    if call.done:
        return 0.0
    delay = call.retry_in(err)
    if delay is None:
        raise _error(call.reported(err)) from None
    return delay


class Client:
    """Unset sampling fields take the server's defaults (the sampling table of docs/configuration.md).

    The keyword arguments are `build_request`'s: the prompt (prompt, token_ids or messages) and the
    sampling controls of `pagedserve.v1.SamplingParams` (stop may be one string or several). `tls`,
    `ca_file` and `api_key` are for a gateway with TLS or API keys (the module's docstring).

    `target`: one gateway, or several (a list, or "HOST:PORT,HOST:PORT"). A stream that breaks with
    UNAVAILABLE is resumed on the next one (on the same one once it is back, when there is one), for up to
    `resume_timeout` seconds without a response (0: never; the error is raised at once); `timeout` bounds
    each whole request, resumes included.
    """

    def __init__(
        self,
        target: str | Sequence[str] = "127.0.0.1:50051",
        timeout: float | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        api_key: str | None = None,
        resume_timeout: float = RESUME_TIMEOUT_S,
    ) -> None:
        secure = credentials(tls, ca_file)
        names = target_list(target)
        self._channels = [channel(name, secure, RECONNECT_OPTIONS) for name in names]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]
        self._targets = Targets(names)
        self._metadata = auth_metadata(api_key)
        self.timeout, self.resume_timeout = timeout, resume_timeout

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        """Yields chunks as the server produces them; GenerationError on a refused or failed request."""
        call = Call(build_request(prompt, **kwargs), self._targets, self.resume_timeout, self.timeout)
        while not call.done:
            target, request, timeout = call.attempt()
            rpc = self._stubs[target].Generate(request, timeout=timeout, metadata=self._metadata)
            try:
                for response in rpc:
                    call.received(response)
                    yield to_chunk(response, call.resumes)
                return
            except grpc.RpcError as err:
                delay = _after_break(call, err)
            finally:
                rpc.cancel()
            time.sleep(delay)

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole completion at once: token_ids, text, finish_reason, usage."""
        (result,) = self.generate_n(prompt, n=1, **kwargs)
        return result

    def generate_n(self, prompt: str | None = None, n: int = 1, **kwargs) -> list[Completion]:
        """n samples of one prompt whose KV is computed once; sample i uses seed + i when seeded."""
        results = [Completion() for _ in range(n)]
        for chunk in self.stream(prompt, n=n, **kwargs):
            add(results[chunk.index], chunk)
        return results

    def embed(
        self,
        inputs: Inputs,
        dimensions: int | None = None,
        priority: int = 0,
        request_id: str = "",
        lora_adapter: str = "",
    ) -> Embeddings:
        """One embedding per input (a text, a list of token ids, or a list of either), in order;
        `dimensions` truncates them where the model allows (docs/embeddings.md); `lora_adapter` embeds
        through that adapter. GenerationError on a refused or failed request."""
        request = embed_request(inputs, dimensions, priority, request_id, lora_adapter)
        return to_embeddings(self._unary("Embed", request))

    def score(self, query: str | Sequence[str], documents: str | Sequence[str], **kwargs) -> Scores:
        """A relevance score per document for `query` (or per pair, given as many queries as documents)
        from a scoring model (docs/embeddings.md); kwargs: priority, request_id, lora_adapter."""
        return to_scores(self._unary("Score", score_request(query, documents, **kwargs)))

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], n: int = 1, **kwargs
    ) -> list[Completion]:
        """n samples of each prompt (texts or token-id lists) in one request: prompt p's sample i at
        p * n + i. A batch that breaks is not resumed (its error is raised)."""
        results = [Completion() for _ in range(len(prompts) * n)]
        for chunk in self.stream(prompts=prompts, n=n, **kwargs):
            add(results[chunk.index], chunk)
        return results

    def tokenize(self, prompt: str | None = None, **kwargs) -> generation_pb2.TokenizeResponse:
        """A prompt's or chat's (messages=) token ids as generate encodes them; TokenizeRequest's other fields
        as keywords."""
        return self._unary("Tokenize", tokenize_request(prompt, **kwargs))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._unary("Detokenize", generation_pb2.DetokenizeRequest(token_ids=token_ids)).text

    def info(self) -> generation_pb2.GetInfoResponse:
        """The current gateway's model and cache."""
        return self._unary("GetInfo", generation_pb2.GetInfoRequest())

    def _unary(self, method: str, request):
        try:
            call = getattr(self._stubs[self._targets.current], method)
            return call(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _error(err) from None

    def close(self) -> None:
        for chan in self._channels:
            chan.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio (grpc.aio): the same methods, awaited; create it inside the running event loop.

    `timeout` bounds each whole request, resumes included; when it passes the request ends with
    DEADLINE_EXCEEDED. `target` and `resume_timeout` as for `Client`.
    """

    def __init__(
        self,
        target: str | Sequence[str] = "127.0.0.1:50051",
        timeout: float | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        api_key: str | None = None,
        resume_timeout: float = RESUME_TIMEOUT_S,
    ) -> None:
        secure, names = credentials(tls, ca_file), target_list(target)
        options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
        self._channels = [
            grpc.aio.insecure_channel(name, options=options)
            if secure is None
            else grpc.aio.secure_channel(name, secure, options=options)
            for name in names
        ]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]
        self._targets = Targets(names)
        self._metadata = auth_metadata(api_key)
        self.timeout, self.resume_timeout = timeout, resume_timeout

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Yields chunks as the server produces them; GenerationError on a refused or failed request."""
        call = Call(build_request(prompt, **kwargs), self._targets, self.resume_timeout, self.timeout)
        while not call.done:
            target, request, timeout = call.attempt()
            rpc = self._stubs[target].Generate(request, timeout=timeout, metadata=self._metadata)
            try:
                async for response in rpc:
                    call.received(response)
                    yield to_chunk(response, call.resumes)
                return
            except grpc.RpcError as err:
                delay = _after_break(call, err)
            finally:
                rpc.cancel()
            await asyncio.sleep(delay)

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole completion at once: token_ids, text, finish_reason, usage."""
        (result,) = await self.generate_n(prompt, n=1, **kwargs)
        return result

    async def generate_n(self, prompt: str | None = None, n: int = 1, **kwargs) -> list[Completion]:
        """n samples of one prompt whose KV is computed once; sample i uses seed + i when seeded."""
        results = [Completion() for _ in range(n)]
        async for chunk in self.stream(prompt, n=n, **kwargs):
            add(results[chunk.index], chunk)
        return results

    async def embed(
        self,
        inputs: Inputs,
        dimensions: int | None = None,
        priority: int = 0,
        request_id: str = "",
        lora_adapter: str = "",
    ) -> Embeddings:
        """One embedding per input, in order (see Client.embed)."""
        request = embed_request(inputs, dimensions, priority, request_id, lora_adapter)
        return to_embeddings(await self._unary("Embed", request))

    async def score(self, query: str | Sequence[str], documents: str | Sequence[str], **kwargs) -> Scores:
        """A relevance score per document (see Client.score)."""
        return to_scores(await self._unary("Score", score_request(query, documents, **kwargs)))

    async def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], n: int = 1, **kwargs
    ) -> list[Completion]:
        """As Client.generate_batch."""
        results = [Completion() for _ in range(len(prompts) * n)]
        async for chunk in self.stream(prompts=prompts, n=n, **kwargs):
            add(results[chunk.index], chunk)
        return results

    async def tokenize(self, prompt: str | None = None, **kwargs) -> generation_pb2.TokenizeResponse:
        """As Client.tokenize."""
        return await self._unary("Tokenize", tokenize_request(prompt, **kwargs))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return (await self._unary("Detokenize", generation_pb2.DetokenizeRequest(token_ids=token_ids))).text

    async def info(self) -> generation_pb2.GetInfoResponse:
        """The current gateway's model and cache."""
        return await self._unary("GetInfo", generation_pb2.GetInfoRequest())

    async def _unary(self, method: str, request):
        try:
            call = getattr(self._stubs[self._targets.current], method)
            return await call(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _error(err) from None

    async def close(self) -> None:
        for chan in self._channels:
            await chan.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
