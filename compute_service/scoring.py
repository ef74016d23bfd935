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


def classifies(config: PretrainedConfig, from_tokens: bool = False) -> bool:
    """Whether the model scores: a sequence classifier (its config's `architectures`), refused
    (UnsupportedScoring) unless it has one label; or a causal LM scored from its logits of some tokens
    (`from_tokens`), refused where those logits are soft-capped."""
    names = [name for name in config.architectures or () if name.endswith("ForSequenceClassification")]
    if from_tokens:
        if names or getattr(config, "final_logit_softcapping", None):
            raise UnsupportedScoring(
                "--classifier-from-token scores a causal LM from its raw output logits: not a "
                f"{names[0] if names else 'model whose logits are soft-capped (final_logit_softcapping)'}"
            )
        return True
    if names and config.num_labels != 1:
        raise UnsupportedScoring(
            f"{names[0]} has {config.num_labels} labels: pagedserve scores with a classifier of one label "
            "(a cross-encoder or reranker), whose sigmoid is the relevance score"
        )
    return bool(names)


def head(model_dir: Path, config: PretrainedConfig, tokens: list[str] | None = None) -> torch.Tensor:
    """The score weight [1, hidden] float32 read from the model's files: a classifier's `score` weight or,
    given `tokens` (--classifier-from-token), the output head's rows of YES minus NO (softmax([NO, YES])
    [YES] is the sigmoid of their logits' difference) or of the one token. UnsupportedScoring when the
    files do not hold it."""
    if tokens:
        return _token_head(model_dir, config, tokens)
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


def _token_head(model_dir: Path, config: PretrainedConfig, tokens: list[str]) -> torch.Tensor:
    if len(tokens) > 2:
        raise UnsupportedScoring(f"--classifier-from-token takes NO YES or one token, not {len(tokens)}")
    from transformers import AutoTokenizer

    vocabulary = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    missing = [token for token in tokens if token not in vocabulary]
    if missing:
        raise UnsupportedScoring(
            f"--classifier-from-token: {missing} not tokens of the model's vocabulary (give tokens as the "
            "tokenizer spells them, e.g. no yes)"
        )
    ids = [vocabulary[token] for token in tokens]
    key = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            if key in weights.keys():  # noqa: SIM118 (not a dict)
                rows = torch.stack([weights.get_slice(key)[i] for i in ids]).float()
                return (rows[-1] - rows[0] if len(ids) == 2 else rows[0])[None]
    raise UnsupportedScoring(f"{model_dir}: no safetensors file holds {key}, the output head")
