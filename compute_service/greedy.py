"""The sampling fast path of a batch in which every row is greedy, unpenalised and asks for no top-n
log-probabilities: the argmax and its log-probability, with no [S, V] log-softmax written.
"""

from types import ModuleType

import torch

from compute_service.sampling import Sampled, SamplingBatch


def is_plain_greedy(batch: SamplingBatch) -> bool:
    """True when `sample` would return the argmax of the raw logits and nothing else."""
    adjusted = len(batch.cu_history) or len(batch.bias_ids) or len(batch.suppress_ids) or batch.constrained
    return not adjusted and not bool((batch.temperature > 0).any() or batch.wants_logprobs.any())


def greedy(logits: torch.Tensor, kernels: ModuleType | None) -> Sampled:
    """logits [S, V] -> the first most likely token of each row and its log-probability, as `sample` gives
    them for a plain greedy batch (the log-probability up to float rounding).

    NOTE: float32 logits go to the native kernels' `greedy` where given (compute_service.kernels, as the
    execution plan's `sampling.greedy` says): one pass for each row's maximum and one for its sum of
    exponentials, where torch's ops write [S, V] temporaries in four passes
    (docs/internals/fused-layers.md)."""
    if kernels is not None and logits.dtype == torch.float32:
        tokens, logprobs = kernels.greedy(logits.contiguous())
    else:
        best, tokens = logits.max(1, keepdim=True)
        # log p(best) = -log Σ exp(logit - best): one pass over the vocabulary, no log-softmax written
        logprobs = -(logits - best).exp_().sum(1).log_()
        tokens = tokens.squeeze(1)
    empty = logits.new_empty(0, 0)  # no row asks for top-n log-probabilities
    return Sampled(tokens, logprobs, empty.long(), empty)
