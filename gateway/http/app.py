"""The gateway's HTTP app: one ASGI app (FastAPI), served by uvicorn in the gateway process beside the gRPC
server. Each part of the front adds its routes through an installer, so the app is assembled in one place."""

from collections.abc import Callable, Iterable

from fastapi import FastAPI

# Adds one part's routes (and what they need) to the app.
Installer = Callable[[FastAPI], None]


def create_app(installers: Iterable[Installer]) -> FastAPI:
    """The app with every installer's routes; no interactive docs (the API is OpenAI's, documented there)."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    for install in installers:
        install(app)
    return app
