"""The SDK moved to `sdk.client`; this re-export keeps `from gateway.client import Client` working."""

from sdk.client import AsyncClient, Client, GenerationError

__all__ = ["AsyncClient", "Client", "GenerationError"]
