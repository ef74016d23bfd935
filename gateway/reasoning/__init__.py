"""Reasoning models (docs/reasoning.md): the text a model writes between its reasoning tags (or in gpt-oss's
analysis channel) split from its answer as it streams (GenerateResponse.reasoning_text), and constraints and
forced tool calls applied to the answer after the reasoning."""
