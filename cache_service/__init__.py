"""The cache service: owns the paged KV pool, its allocator and the block table of every sequence."""
