"""GET /metrics on the HTTP API's port (--http-metrics): the gateway's Prometheus registry, as --metrics-port
serves it, for scrapers that read a model server's API port as vLLM serves it there (the Gateway API
Inference Extension's endpoint picker scrapes the InferencePool's target port by default). Open, like /health:
it holds counts and latencies, no request's text."""

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


def install(app: FastAPI) -> None:
    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
