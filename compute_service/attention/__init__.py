"""Paged attention: the per-step context, the backends registered with transformers, a dense reference."""
