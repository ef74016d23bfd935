"""Scoring models (compute_service.scoring): a decoder sequence classifier of one label scores by its last
token; compute's pooled row times the score weight read from the checkpoint is transformers' logit; other
classifiers and checkpoints without the weight are refused, saying what is scored; a causal LM's head of
`yes` minus `no` (--classifier-from-token) gives the softmax of those logits."""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
)

from common.model_files import local_copy
from compute_service import scoring
from compute_service.pooling import UnsupportedPooling, pool, resolve
from tests.tiny_model import TINY_SHAPE, save_tiny_llama


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


def test_a_causal_lms_yes_minus_no_head_gives_the_softmax_of_their_logits(tmp_path):
    path = save_tiny_llama(tmp_path, vocab_size=49152, initializer_range=0.3)
    AutoTokenizer.from_pretrained(local_copy("smollm2").path).save_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert resolve("auto", path, config, from_tokens=True).source == "score"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 31, 7, 100]])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0]
        logits = model(ids).logits[0, -1]
    no, yes = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(["no", "yes"])
    logit = pool("last", hidden, torch.tensor([0, 5]), [0]) @ scoring.head(path, config, ["no", "yes"]).T
    expected = torch.softmax(logits[[no, yes]], 0)[1]
    torch.testing.assert_close(torch.sigmoid(logit[0, 0]), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(scoring.UnsupportedScoring, match="not tokens of the model's vocabulary"):
        scoring.head(path, config, ["no", "definitely-not-a-token"])
    with pytest.raises(scoring.UnsupportedScoring, match="NO YES or one token, not 3"):
        scoring.head(path, config, ["no", "yes", "maybe"])
    _classifier(tmp_path / "classifier")
    with pytest.raises(scoring.UnsupportedScoring, match="not a LlamaForSequenceClassification"):
        resolve("auto", tmp_path / "classifier", AutoConfig.from_pretrained(tmp_path / "classifier"), True)
