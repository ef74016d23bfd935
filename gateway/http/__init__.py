"""The gateway's HTTP front (FastAPI, served by uvicorn in the gateway process beside gRPC)."""
