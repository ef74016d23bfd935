"""The gateway's HTTP app: one ASGI app (FastAPI), served by uvicorn in the gateway process beside the gRPC
server. Each part of the front adds its routes through an installer, so the app is assembled in one place."""

from collections.abc import Callable, Iterable

from fastapi import FastAPI

from gateway.http.body import BodyLimits
from gateway.limits import EdgeLimits

# Adds one part's routes (and what they need) to the app.
Installer = Callable[[FastAPI], None]


def create_app(installers: Iterable[Installer], limits: EdgeLimits | None = None) -> FastAPI:
    """The app with every installer's routes; no interactive docs (the API is OpenAI's, documented there).
    Every route's request body is bounded and parsed first (gateway.http.body: `request_json`), within
    `limits` (None: the defaults)."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    limits = limits or EdgeLimits()
    app.add_middleware(BodyLimits, max_bytes=limits.max_request_bytes, max_depth=limits.max_request_depth)
    for install in installers:
        install(app)
    return app
