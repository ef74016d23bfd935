"""Scores through a LoRA adapter (docs/adapters.md, docs/embeddings.md): a causal LM scored from its logits of
two tokens (--classifier-from-token) with PEFT adapters named at start; /v1/score, /v1/rerank and gRPC
Score naming an adapter give peft's score of each pair with that adapter (the sigmoid of the two tokens'
logits' difference at the pair's last token, float32), not the base model's."""

import openai
import pytest
import torch

from tests.e2e.stack import start_stack
from tests.lora_adapters import LLAMA_ATTENTION, LLAMA_MLP, peft_model, save_tiny_with_adapters

pytestmark = pytest.mark.e2e

TOL = 1e-4
# NO YES, each one token of the tiny model's 256
NO, YES = "0", "1"
FLAGS = (
    *("--dtype", "float32", "--kv-blocks", "64", "--block-size", "8", "--max-batched-tokens", "24"),
    *("--max-loras", "2", "--max-lora-rank", "8", "--classifier-from-token", NO, YES),
)
ADAPTERS = {"sql": (4, ["q_proj", "v_proj"], False), "chat": (8, LLAMA_ATTENTION + LLAMA_MLP, True)}
# digits and punctuation: token ids inside the tiny model's vocabulary
QUERY = "1,2,3,4,5;6"
DOCUMENTS = ["7,8,9:0", "9;8;7;6;5;4;3;2;1;0", "0.5"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, logs):
    """(stack, peft's model with every adapter)."""
    model_dir, paths = save_tiny_with_adapters(
        tmp_path_factory.mktemp("lora-scores"), "llama3-rope", tokenizer, ADAPTERS
    )
    modules = [f"{name}={path}" for name, path in paths.items()]
    stack = start_stack(logs, "--model", str(model_dir), *FLAGS, "--lora-modules", *modules)
    yield stack, peft_model(model_dir, paths)
    assert stack.stop() == 0


def _expected(model, tokenizer, adapter: str) -> torch.Tensor:
    """peft's score of each (QUERY, document) pair: softmax([logit NO, logit YES])[YES] at its last token."""
    no, yes = tokenizer.convert_tokens_to_ids([NO, YES])
    scores = []
    for document in DOCUMENTS:
        ids = torch.tensor([tokenizer(QUERY, document)["input_ids"]])
        if adapter:
            model.set_adapter(adapter)
            logits = model(ids).logits[0, -1]
        else:
            with model.disable_adapter():
                logits = model(ids).logits[0, -1]
        scores.append(torch.sigmoid(logits[yes] - logits[no]))
    return torch.stack(scores)


@torch.inference_mode()
def test_scores_through_an_adapter_are_peft_s(served, tokenizer):
    stack, reference = served
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300) as api:
        score = api.post(
            "/score", body={"model": "chat", "text_1": QUERY, "text_2": DOCUMENTS}, cast_to=object
        )
        rerank = api.post(
            "/rerank", body={"model": "chat", "query": QUERY, "documents": DOCUMENTS}, cast_to=object
        )
        base = api.post("/score", body={"text_1": QUERY, "text_2": DOCUMENTS}, cast_to=object)
    with stack.client() as client:
        grpc = client.score(QUERY, DOCUMENTS, lora_adapter="chat")
    expected, expected_base = (_expected(reference, tokenizer, adapter) for adapter in ("chat", ""))
    reranked = sorted(rerank["results"], key=lambda result: result["index"])
    got = {
        "score": [item["score"] for item in score["data"]],
        "rerank": [result["relevance_score"] for result in reranked],
        "grpc": list(grpc.scores),
    }
    for path, scores in got.items():
        torch.testing.assert_close(
            torch.tensor(scores), expected, atol=TOL, rtol=0, msg=lambda m, path=path: f"{path}: {m}"
        )
    base_scores = torch.tensor([item["score"] for item in base["data"]])
    torch.testing.assert_close(base_scores, expected_base, atol=TOL, rtol=0)
    assert (expected - expected_base).abs().max() > 100 * TOL, "the adapter changes the scores"
    assert score["model"] == rerank["model"] == grpc.model == "chat"
