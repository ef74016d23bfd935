"""EventStream: a response's events are closed however the response ends."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from gateway.http.bridge import EventStream


def _events(closed: list[bool]):
    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    return events()


def test_events_of_a_client_gone_mid_send_are_closed_when_the_response_ends():
    """ASGI 2.3 (uvicorn's HTTP): the disconnect cancels a send waiting on a client that stopped reading."""
    closed: list[bool] = []

    async def run() -> None:
        sending = asyncio.Event()

        async def send(message) -> None:
            if message["type"] == "http.response.body":
                sending.set()
                await asyncio.Event().wait()  # the client's window is full: the send never completes

        async def receive():
            await sending.wait()
            return {"type": "http.disconnect"}

        response = EventStream(_events(closed), {})
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        assert closed == [True], "the events still held, waiting for the garbage collector"

    asyncio.run(run())


def test_events_of_a_client_gone_are_closed_when_a_send_fails():
    """ASGI 2.4: a send to a client gone raises OSError."""
    closed: list[bool] = []
    sent: list[bytes] = []

    async def run() -> None:
        async def send(message) -> None:
            if message["type"] == "http.response.body" and sent:
                raise OSError("the client is gone")
            sent.append(message.get("body", b""))

        async def receive():
            await asyncio.Event().wait()

        response = EventStream(_events(closed), {})
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert closed == [True]

    asyncio.run(run())
