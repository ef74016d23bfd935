"""Code shared by the three services: errors, gRPC bootstrap, logging, the shared KV pool, model files."""
