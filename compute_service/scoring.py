"""Scoring models (docs/embeddings.md, Scores): a decoder *ForSequenceClassification of one label, as vLLM's
score and rerank routes serve a cross-encoder. Its score is its `score` linear (no bias) applied to the last
token's final hidden state: compute loads the decoder as a causal LM (the same layers and final norm), reads
the `score` weight from the checkpoint itself, pools each scored row by its last token and returns the one
logit; the gateway takes its sigmoid."""

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

SCORE = "score.weight"


class UnsupportedScoring(ValueError):
    """A classification model compute cannot score with; the message says what it scores with."""


def classifies(config: PretrainedConfig) -> bool:
    """Whether the model directory holds a sequence classifier (its config's `architectures`); refused
    (UnsupportedScoring) unless it has one label."""
    names = [name for name in config.architectures or () if name.endswith("ForSequenceClassification")]
    if names and config.num_labels != 1:
        raise UnsupportedScoring(
            f"{names[0]} has {config.num_labels} labels: pagedserve scores with a classifier of one label "
            "(a cross-encoder or reranker), whose sigmoid is the relevance score"
        )
    return bool(names)


def head(model_dir: Path, config: PretrainedConfig) -> torch.Tensor:
    """The score weight [1, hidden] float32 from the model's safetensors files; UnsupportedScoring when
    none holds it at that shape."""
    hidden_size = config.hidden_size
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            if SCORE in weights.keys():  # noqa: SIM118 (not a dict)
                weight = weights.get_tensor(SCORE).float()
                if tuple(weight.shape) != (1, hidden_size):
                    raise UnsupportedScoring(
                        f"{path}: {SCORE} is {list(weight.shape)}, not [1, {hidden_size}] (one label)"
                    )
                return weight
    raise UnsupportedScoring(f"{model_dir}: no safetensors file holds {SCORE}, the classifier's weight")
