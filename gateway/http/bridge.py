"""From the event loop to the gateway's generation path: each HTTP request's Generation.stream runs to
its end in a worker thread of its own, its replies handed to the loop; the request's end (its response
done, or its client gone) ends the call, which aborts its sequence and frees its blocks."""

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.auth import Tenant
from gateway.embedding import Embeddings
from gateway.generation import CallEnd, Generation
from gateway.scoring import Scores
from protos import generation_pb2

_END = object()
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class Bridge:
    """Worker threads for the HTTP requests' generations: as many as --max-streams, which bounds the
    streams of both fronts together (Generation.stream refuses beyond it), so a request never waits for
    a thread."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.embeddings = Embeddings(generation)
        self.scores = Scores(self.embeddings)
        self._workers = ThreadPoolExecutor(generation.slots.limit, thread_name_prefix="http-generate")

    async def replies(
        self, request: generation_pb2.GenerateRequest, tenant: Tenant
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's replies; raises its error. Closing the iterator early (a client gone) ends the
        call: the engine aborts the sequence."""
        loop, queue, end = asyncio.get_running_loop(), asyncio.Queue(), CallEnd()

        def hand(item: object) -> None:
            # NOTE: the loop is closed only after the drain, when no generation runs any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:
            try:
                for reply in self.generation.stream(request, tenant, end.add):
                    hand(reply)
                hand(_END)
            except Exception as exc:  # noqa: BLE001 - the request's error, raised on the loop's side
                hand(exc)
            finally:
                end.end()

        # NOTE: the worker runs in a copy of this task's context: its log lines carry the request's ids.
        loop.run_in_executor(self._workers, contextvars.copy_context().run, pump)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            end.end()

    async def embed(
        self, request: generation_pb2.EmbedRequest, tenant: Tenant
    ) -> generation_pb2.EmbedResponse:
        """The request's embeddings (gateway.embedding), in a worker thread; raises its error. Cancelling
        the await (a client gone) ends the call: the engine aborts its inputs."""
        return await self._unary(self.embeddings.embed, request, tenant)

    async def score(
        self, request: generation_pb2.ScoreRequest, tenant: Tenant
    ) -> generation_pb2.ScoreResponse:
        """The request's scores (gateway.scoring), as `embed` runs embeddings."""
        return await self._unary(self.scores.score, request, tenant)

    async def _unary(self, serve, request, tenant: Tenant):
        loop, end = asyncio.get_running_loop(), CallEnd()

        def work():
            try:
                return serve(request, tenant, end.add)
            finally:
                end.end()

        try:
            return await loop.run_in_executor(self._workers, contextvars.copy_context().run, work)
        finally:
            end.end()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A request's server-sent events, the iterator closed however the response ends. A client gone while an
    event was being sent leaves the iterator suspended at its yield: closed here, it ends the call at once,
    not when the garbage collector finds it."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
