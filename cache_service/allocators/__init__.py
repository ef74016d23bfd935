"""Physical block allocators, chosen by name from `registry`."""
