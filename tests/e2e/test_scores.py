"""Scores through the real services (POST /v1/score and /v1/rerank, gRPC Score through the SDK) from a tiny
random-weight LlamaForSequenceClassification of one label (a decoder cross-encoder), checked against
transformers' sigmoid of the classifier's logit on the same weights and the same pair tokens, and from a
causal LM scored from its `no`/`yes` logits (a Qwen3-Reranker's way, --classifier-from-token) against
transformers' softmax of them; a model that cannot score is refused with a 400, a scoring model refuses
generation and embeddings."""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
)

from sdk.client import Client, GenerationError
from tests.e2e.stack import start_stack
from tests.tiny_model import TINY_SHAPE, save_tiny_llama

pytestmark = pytest.mark.e2e
QUERY = "Which city is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The mitochondria is the powerhouse of the cell.",
    "Berlin is the capital of Germany; " * 4,
    "France",
]
# float32, the same weights and tokens: the logits differ by summation order only.
CLOSE = 1e-4


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, model_dir):
    """The classifier's directory (with the default model's tokenizer) and transformers' model of it."""
    path = tmp_path_factory.mktemp("scorer")
    config = LlamaConfig(
        **{**TINY_SHAPE, "vocab_size": 49152}, num_labels=1, pad_token_id=0, initializer_range=0.3
    )
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, model_dir):
    """A causal Llama (the default model's tokenizer) scored from its `no` and `yes` logits, as a
    Qwen3-Reranker is, and transformers' model of it."""
    path = save_tiny_llama(tmp_path_factory.mktemp("reranker"), vocab_size=49152, initializer_range=0.3)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stacks(scorer, reranker, logs):
    """The classifier's stack and the reranker's (--classifier-from-token no yes), side by side."""
    flags = ("--dtype", "float32", "--kv-blocks", "64")
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(start_stack, logs, "--model", str(scorer[0]), *flags),
            pool.submit(
                start_stack, logs, "--model", str(reranker[0]), *flags, "--classifier-from-token", "no", "yes"
            ),
        ]
        started = [future.result() for future in futures]
    yield started
    assert [each.stop() for each in started] == [0, 0]


@pytest.fixture(scope="module")
def stack(stacks):
    return stacks[0]


def _expected(scorer, queries: list[str], documents: list[str]) -> list[float]:
    path, model = scorer
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [
            torch.sigmoid(model(torch.tensor([tokenizer(q, d)["input_ids"]])).logits[0, 0]).item()
            for q, d in zip(queries, documents, strict=True)
        ]


def _post(stack, route: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.http_url}/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_score_gives_transformers_sigmoid_of_the_classifier(stack, scorer):
    expected = _expected(scorer, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    status, body = _post(stack, "score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
    assert [item["score"] for item in body["data"]] == pytest.approx(expected, abs=CLOSE)
    assert max(expected) - min(expected) > 0.05, "the documents score apart"
    pairwise = _expected(scorer, DOCUMENTS[:2], DOCUMENTS[2:])
    status, body = _post(stack, "score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]})
    assert [item["score"] for item in body["data"]] == pytest.approx(pairwise, abs=CLOSE)
    assert body["usage"]["prompt_tokens"] > 0


def test_rerank_orders_documents_by_score(stack, scorer):
    expected = _expected(scorer, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    status, body = _post(stack, "rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert status == 200, body
    assert [item["index"] for item in body["results"]] == order[:3]
    for item in body["results"]:
        assert item["relevance_score"] == pytest.approx(expected[item["index"]], abs=CLOSE)
        assert item["document"] == {"text": DOCUMENTS[item["index"]]}
    _, bare = _post(stack, "rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [item["index"] for item in bare["results"]] == order
    assert all("document" not in item for item in bare["results"])


def test_sdk_scores_as_http(stack, scorer):
    expected = _expected(scorer, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    with Client(stack.target, timeout=300) as client:
        result = client.score(QUERY, DOCUMENTS)
        assert result.scores == pytest.approx(expected, abs=CLOSE) and result.usage.prompt_tokens > 0
        with pytest.raises(GenerationError, match="queries has 2 entries for 3 documents") as err:
            client.score(DOCUMENTS[:2], DOCUMENTS[:3])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(GenerationError, match="serves scores .* not generation"):
            client.generate("hello", max_tokens=2)
        with pytest.raises(GenerationError, match="serves scores .* not embeddings"):
            client.embed("hello")


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("rerank", {"query": QUERY, "documents": []}, "documents", "documents is empty"),
        ("rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n", "top_n is 0"),
        ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "has 2 entries for 3"),
        ("score", {"text_1": "a", "text_2": "b", "model": "nope"}, "model", "'nope' does not exist"),
    ],
)
def test_bad_bodies_are_refused(stack, route, body, param, says):
    status, reply = _post(stack, route, body)
    assert status in (400, 404) and says in reply["error"]["message"], reply
    assert reply["error"]["param"] == param


def test_a_model_that_cannot_score_is_refused_with_a_400(stack_fp32):
    status, reply = _post(stack_fp32, "rerank", {"query": QUERY, "documents": DOCUMENTS[:1]})
    assert status == 400 and reply["error"]["param"] == "model", reply
    assert "cannot score" in reply["error"]["message"]
    with openai.OpenAI(base_url=stack_fp32.http_url, api_key="unused", max_retries=0) as api:
        assert api.completions.create(model=api.models.list().data[0].id, prompt="hi", max_tokens=2).usage


def test_a_causal_lm_scores_from_its_yes_and_no_logits(stacks, reranker):
    """softmax([no, yes])[yes] of transformers' logits at the pair's last token."""
    path, model = reranker
    tokenizer = AutoTokenizer.from_pretrained(path)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    expected = []
    with torch.no_grad():
        for document in DOCUMENTS:
            logits = model(torch.tensor([tokenizer(QUERY, document)["input_ids"]])).logits[0, -1]
            expected.append(torch.softmax(logits[[no, yes]], 0)[1].item())
    status, body = _post(stacks[1], "rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert [item["index"] for item in body["results"]] == sorted(range(4), key=lambda i: -expected[i])
    for item in body["results"]:
        assert item["relevance_score"] == pytest.approx(expected[item["index"]], abs=CLOSE)
