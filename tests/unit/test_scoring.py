"""Scoring models (compute_service.scoring): a decoder sequence classifier of one label scores by its last
token; compute's pooled row times the score weight read from the checkpoint is transformers' logit; other
classifiers and checkpoints without the weight are refused, saying what is scored."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, LlamaConfig

from compute_service import scoring
from compute_service.pooling import UnsupportedPooling, pool, resolve
from tests.tiny_model import TINY_SHAPE


def _classifier(path, labels: int = 1):
    config = LlamaConfig(**TINY_SHAPE, num_labels=labels, pad_token_id=0, initializer_range=0.3)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(path)
    return model


def test_the_pooled_last_token_times_the_score_weight_is_transformers_logit(tmp_path):
    model = _classifier(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    pooling = resolve("auto", tmp_path, config)
    declared = (pooling.mode, pooling.normalize, pooling.dimensions, pooling.source)
    assert declared == ("last", False, 1, "score")
    ids = torch.tensor([[5, 9, 31, 7, 100]])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0]
        expected = model(ids).logits[0]
    got = pool("last", hidden, torch.tensor([0, 5]), [0]) @ scoring.head(tmp_path, config).T
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)


def test_classifiers_that_cannot_score_are_refused(tmp_path):
    _classifier(tmp_path / "two", labels=2)
    with pytest.raises(scoring.UnsupportedScoring, match="has 2 labels: pagedserve scores with .* one label"):
        resolve("auto", tmp_path / "two", AutoConfig.from_pretrained(tmp_path / "two"))
    _classifier(tmp_path / "one")
    config = AutoConfig.from_pretrained(tmp_path / "one")
    with pytest.raises(UnsupportedPooling, match="--pooling mean: a sequence-classification model"):
        resolve("mean", tmp_path / "one", config)
    assert resolve("off", tmp_path / "one", config) is None
    (tmp_path / "one" / "model.safetensors").rename(tmp_path / "elsewhere")
    with pytest.raises(scoring.UnsupportedScoring, match="no safetensors file holds score.weight"):
        scoring.head(tmp_path / "one", config)
