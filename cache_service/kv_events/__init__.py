"""KV cache events: the prefix index's changes, published over ZMQ in vLLM's format for KV-cache-aware
routers."""
