"""`pagedserve bench`: the BENCHMARKS.md workloads through the public API, peers in the same run."""
