"""The compute service: loads the model, runs packed paged-attention steps on the shared KV pool, samples."""
