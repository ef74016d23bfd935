"""The Python SDK of pagedserve's public API (`pagedserve.v1.Generation`)."""

from sdk.client import AsyncClient, Client, GenerationError

__all__ = ["AsyncClient", "Client", "GenerationError"]
