"""The public face of pagedserve: API, tokenization, continuous batching, streaming, SDK and CLI."""
