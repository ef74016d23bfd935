"""The pagedserve.v1 gRPC contracts and their generated Python modules."""
