"""The sampling fast path of a batch in which every row is greedy, unpenalised and asks for no top-n
log-probabilities: the argmax and its log-probability, with no [S, V] log-softmax written.
"""

import torch

from compute_service.sampling import Sampled, SamplingBatch


def is_plain_greedy(batch: SamplingBatch) -> bool:
    """True when `sample` would return the argmax of the raw logits and nothing else."""
    adjusted = len(batch.cu_history) or len(batch.bias_ids) or len(batch.suppress_ids)
    return not adjusted and not bool((batch.temperature > 0).any() or batch.wants_logprobs.any())


def greedy(logits: torch.Tensor) -> Sampled:
    """logits [S, V] -> the first most likely token of each row and its log-probability, as `sample` gives
    them for a plain greedy batch (the log-probability up to float rounding)."""
    best, tokens = logits.max(1, keepdim=True)
    # log p(best) = -log Σ exp(logit - best): one pass over the vocabulary, no log-softmax written
    logprobs = -(logits - best).exp_().sum(1).log_()
    tokens = tokens.squeeze(1)
    empty = logits.new_empty(0, 0)  # no row asks for top-n log-probabilities
    return Sampled(tokens, logprobs, empty.long(), empty)
