"""LoRA adapters over HTTP, in vLLM's shape (docs/adapters.md): a request's `model` names the base model or
one of its adapters; GET /v1/models lists each adapter with its `parent`; POST /v1/load_lora_adapter
(`lora_name`, `lora_path`) and /v1/unload_lora_adapter (`lora_name`) load and unload them at run time,
behind the same API keys as the other routes."""

from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from common.errors import InvalidArgument, PagedServeError
from gateway.http.app import Installer
from gateway.http.body import request_json
from gateway.http.errors import HttpError, from_gateway
from gateway.http.openai_request import model_error, parse

if TYPE_CHECKING:
    from gateway.http.openai_api import Front


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def adapter_of(front: "Front", model: str | None, served: str) -> str:
    """The adapter a request's `model` names ("" for the base model: none, its name or an alias); 404 for
    a name that is neither."""
    if model in (None, served, *front.aliases):
        return ""
    try:
        front.generation.adapters.resolve(model)
    except InvalidArgument as err:
        raise model_error(model, served) from err
    return model


def adapter_cards(front: "Front", base: dict) -> list[dict]:
    """GET /v1/models' entries of the resident adapters, as vLLM lists them: `root` their directory,
    `parent` the base model's id."""
    return [
        {**base, "id": adapter.name, "root": adapter.path, "parent": base["id"]}
        for adapter in front.generation.adapters.listed()
    ]


def lora_api(front: "Front") -> Installer:
    def install(app: FastAPI) -> None:
        app.include_router(_router(front))

    return install


def _router(front: "Front") -> APIRouter:
    router = APIRouter()
    adapters = front.generation.adapters

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        async def answer() -> str:
            body = _body(front, request, LoadAdapter)
            await run_in_threadpool(adapters.load, body.lora_name, body.lora_path)
            return f"Success: LoRA adapter '{body.lora_name}' added successfully."

        return await _refusing(answer)

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        async def answer() -> str:
            body = _body(front, request, UnloadAdapter)
            await run_in_threadpool(adapters.unload, body.lora_name)
            return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

        return await _refusing(answer)

    return router


def _body(front: "Front", request: Request, kind: type[BaseModel]) -> BaseModel:
    front.generation.edge.authenticate(request.headers.items())
    body = request_json(request)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", "invalid_request_error")
    return parse(kind, body)


async def _refusing(answer) -> Response:
    try:
        return PlainTextResponse(await answer())
    except HttpError as err:
        return err.response()
    except PagedServeError as err:
        return from_gateway(err).response()
