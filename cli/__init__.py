"""The `pagedserve` command: start the stack, generate, benchmark, watch and inspect it from the terminal."""
