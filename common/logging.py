"""One structlog setup for every service: JSON lines or a readable console."""

import logging
import sys

import structlog


def configure(service: str, fmt: str = "console", level: str = "info") -> structlog.stdlib.BoundLogger:
    """Every line of this process names `service`, and carries the request_id bound by the gRPC server."""

    def add_service(logger, method: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()
