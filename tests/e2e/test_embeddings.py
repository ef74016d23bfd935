"""Embeddings through the real services (POST /v1/embeddings with the `openai` client, gRPC Embed through the
SDK and the CLI) checked against sentence-transformers' `encode` on the same weights: a decoder of
Qwen3-Embedding's shape pooled by its last token as its modules.json declares, and a plain Llama pooled by
mean under --pooling mean, and the Qwen3-shaped one through a LoRA adapter against sentence-transformers with
the adapter merged by peft. Steps of 64 tokens, so that long inputs run in several chunks; generation runs
beside them in the same steps."""

import asyncio
import base64
import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from sdk.client import AsyncClient, Client, GenerationError
from tests.e2e.stack import start_stack
from tests.embedding_model import MATRYOSHKA, qwen3_embedding_config, save_sentence_transformer
from tests.helpers import PAGEDSERVE
from tests.lora_adapters import LLAMA_ATTENTION, LLAMA_MLP, save_adapter
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
FLAGS = ("--dtype", "float32", "--kv-blocks", "96", "--max-batched-tokens", "64", "--max-embed-inputs", "40")
TEXTS = [
    "The capital of France is Paris.",
    "hello",
    "Embeddings turn text into vectors; " * 12,  # ~100 tokens: two chunks of 64
    "x y z",
]
# float32: the same input embedded in another batch (other GEMM shapes, another chunking beside other rows)
# differs by float rounding, about 1e-6 relatively per element after a few layers.
ALIKE = 1e-5


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir):
    """The Qwen3-shaped sentence-transformers model, and a plain tiny Llama with the same tokenizer (no chat
    template, as the Qwen3-shaped one's)."""
    root = tmp_path_factory.mktemp("embedding-models")
    qwen3 = save_sentence_transformer(
        root / "qwen3-embedding", qwen3_embedding_config(49152), model_dir, "lasttoken", normalize=True
    )
    llama = save_tiny_llama(root / "llama", vocab_size=49152, initializer_range=0.3)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(llama)
    adapter = save_adapter(qwen3, root / "qwen3-adapter", 4, LLAMA_ATTENTION + LLAMA_MLP, seed=1)
    return {"qwen3": qwen3, "llama": llama, "adapter": adapter}


@pytest.fixture(scope="module")
def stacks(models, logs):
    """last: the Qwen3-shaped model as declared, with a LoRA adapter of it (`tuned`); mean: the plain Llama
    under --pooling mean; none: the same Llama as is (it does not pool). Started side by side."""
    flags = {
        "last": ("--model", str(models["qwen3"]), *FLAGS, "--lora-modules", f"tuned={models['adapter']}"),
        "mean": ("--model", str(models["llama"]), "--pooling", "mean", *FLAGS),
        "none": ("--model", str(models["llama"]), *FLAGS),
    }
    with ThreadPoolExecutor(len(flags)) as pool:
        futures = {name: pool.submit(start_stack, logs, *args) for name, args in flags.items()}
        started = {name: future.result() for name, future in futures.items()}
    yield started
    assert [stack.stop() for stack in started.values()] == [0] * len(started)


@pytest.fixture(scope="module")
def encoders(models):
    """sentence-transformers' models: the Qwen3-shaped one as saved, and the Llama pooled by mean and
    normalised (what --pooling mean means for a model without modules.json)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    transformer = modules.Transformer(str(models["llama"]))
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    return {
        "last": SentenceTransformer(str(models["qwen3"]), device="cpu"),
        "mean": SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu"),
    }


def _merged_encoder(models):
    """sentence-transformers' Qwen3-shaped model with the adapter merged into its weights by peft."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForCausalLM

    encoder = SentenceTransformer(str(models["qwen3"]), device="cpu")
    causal = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32)
    merged = PeftModel.from_pretrained(causal, models["adapter"]).merge_and_unload()
    encoder[0].auto_model.load_state_dict(merged.model.state_dict())
    return encoder


@pytest.fixture(scope="module")
def references(encoders):
    """Their encode of TEXTS, and the tokenizer."""
    return {name: encoder.encode(TEXTS) for name, encoder in encoders.items()} | {
        "tokenizer": encoders["last"].tokenizer
    }


def _api(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300)


def _embed(stack, inputs, **kwargs) -> np.ndarray:
    reply = _api(stack).embeddings.create(model=_model(stack), input=inputs, **kwargs)
    return np.array([item.embedding for item in reply.data])


def _model(stack) -> str:
    return _api(stack).models.list().data[0].id


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_sentence_transformers(stacks, references, pooling):
    """The openai client asks for base64 by default; float gives the same values."""
    api = _api(stacks[pooling])
    reply = api.embeddings.create(model=_model(stacks[pooling]), input=TEXTS)
    got = np.array([item.embedding for item in reply.data])
    assert got.shape == references[pooling].shape
    assert _cosines(got, references[pooling]).min() >= 0.9999
    tokens = sum(len(references["tokenizer"](text)["input_ids"]) for text in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    floats = _embed(stacks[pooling], TEXTS, encoding_format="float")
    assert np.abs(floats - got).max() <= ALIKE


def test_a_batch_and_each_input_alone_embed_alike(stacks):
    rng = np.random.default_rng(0)
    inputs = [rng.integers(100, 49152, size=int(n)).tolist() for n in rng.integers(1, 120, size=32)]
    batched = _embed(stacks["last"], inputs)
    alone = np.stack([_embed(stacks["last"], [ids])[0] for ids in inputs])
    assert np.abs(batched - alone).max() <= ALIKE


def test_token_ids_embed_as_their_text_and_cached_prefixes_are_exact(stacks, encoders, references):
    text = "A sentence only this test embeds, and embeds again. " * 6
    ids = references["tokenizer"](text)["input_ids"]
    with Client(stacks["last"].target, timeout=300) as client:
        first = client.embed(ids)
        again = client.embed([ids, text])
    # last-token pooling shares the prefix cache
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens > 0
    vectors = np.array(again.vectors)
    assert np.abs(vectors - np.array(first.vectors)).max() <= ALIKE
    assert _cosines(vectors, encoders["last"].encode([text, text])).min() >= 0.9999


def test_matryoshka_dimensions_truncate_then_normalise(stacks, references):
    full = references["last"][:2]
    for width in MATRYOSHKA:
        got = _embed(stacks["last"], TEXTS[:2], dimensions=width)
        expected = full[:, :width] / np.linalg.norm(full[:, :width], axis=1, keepdims=True)
        assert got.shape == (2, width) and _cosines(got, expected).min() >= 0.9999
        assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)


def test_embeddings_run_beside_generation_in_the_same_steps(stacks, references):
    """Greedy completions give the same tokens with embedding requests in their steps as alone, and the
    embeddings are sentence-transformers' all the same."""
    stack, prompts = stacks["last"], [f"Story {i}: once upon a time" for i in range(4)]

    def complete(prompt: str) -> list[int]:
        with Client(stack.target, timeout=300) as client:
            return client.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).token_ids

    alone = [complete(prompt) for prompt in prompts]
    results: dict[str, object] = {}

    def embed_many() -> None:
        results["embeddings"] = [_embed(stack, TEXTS) for _ in range(3)]

    embedder = threading.Thread(target=embed_many)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, prompt) for prompt in prompts]
        embedder.start()
        beside = [future.result() for future in futures]
    embedder.join()
    assert beside == alone and all(len(tokens) == 24 for tokens in beside)
    for got in results["embeddings"]:
        assert _cosines(got, references["last"]).min() >= 0.9999


def test_sdk_async_client_and_cli_agree(stacks):
    stack = stacks["last"]
    with Client(stack.target, timeout=300) as client:
        sync = client.embed(TEXTS[:2], dimensions=16)
        info = client.info()

    async def embed():
        async with AsyncClient(stack.target, timeout=300) as client:
            return await client.embed(TEXTS[:2], dimensions=16)

    asynchronous = asyncio.run(embed())
    out = subprocess.run(
        [*PAGEDSERVE, "embed", *TEXTS[:2], "--dimensions", "16", "--target", stack.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert "2 embeddings of 16 dimensions" in out.stderr
    for other in (asynchronous.vectors, printed["embeddings"]):
        assert np.abs(np.array(other) - np.array(sync.vectors)).max() <= ALIKE
    assert (info.pooling, info.embedding_dimensions, list(info.embedding_matryoshka_dimensions)) == (
        "last",
        64,
        MATRYOSHKA,
    )


def test_a_model_that_does_not_pool_refuses_embeddings_and_still_generates(stacks):
    stack = stacks["none"]
    with pytest.raises(openai.BadRequestError) as refused:
        _embed(stack, "hello")
    error = refused.value.body
    assert error["param"] == "model" and "does not pool" in error["message"]
    assert "--pooling last" in error["message"]
    with Client(stack.target, timeout=300) as client:
        with pytest.raises(GenerationError) as grpc_refused:
            client.embed("hello")
        assert grpc_refused.value.code.name == "INVALID_ARGUMENT"
        assert client.info().pooling == "" and client.generate("hi", max_tokens=4).usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "hi", "dimensions": 20}, "dimensions", "one of [16, 32]"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "one of [16, 32]"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": []}, "input", "from 1 to 40"),
        ({"input": ["a"] * 41}, "input", "--max-embed-inputs"),
        ({"input": ["fine", ""]}, "input", "input[1] is empty"),
        ({"input": [[1, 2], [49152]]}, "input", "outside the vocabulary"),
        ({"input": [list(range(100, 613))]}, "input", "at most 512"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_changes_nothing(stacks, references, body, param, says):
    stack = stacks["last"]
    with pytest.raises(openai.BadRequestError) as refused:
        _api(stack).post("/embeddings", body={"model": _model(stack), **body}, cast_to=object)
    error = refused.value.body
    assert error["param"] == param and says in error["message"], error
    got = _embed(stack, TEXTS[:1])
    assert _cosines(got, references["last"][:1]).min() >= 0.9999


def test_base64_is_little_endian_float32(stacks):
    stack = stacks["last"]
    body = {"model": _model(stack), "input": "hi", "encoding_format": "base64"}
    raw = _api(stack).post("/embeddings", body=body, cast_to=object)
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - _embed(stack, "hi", encoding_format="float")[0]).max() == 0


def test_an_adapter_embeds_as_sentence_transformers_with_it_merged(stacks, models, references):
    """The adapter by `model` (OpenAI), lora_adapter (SDK, CLI); base rows beside it stay the base's."""
    stack, expected = stacks["last"], _merged_encoder(models).encode(TEXTS)
    reply = _api(stack).embeddings.create(model="tuned", input=TEXTS)
    tuned = np.array([item.embedding for item in reply.data])
    assert reply.model == "tuned" and _cosines(tuned, expected).min() >= 0.9999
    assert _cosines(tuned, references["last"]).max() < 0.99, "the adapter changes the embeddings"
    with Client(stack.target, timeout=300) as client, ThreadPoolExecutor(2) as pool:
        adapted = pool.submit(client.embed, TEXTS, lora_adapter="tuned")
        base = pool.submit(client.embed, TEXTS)
        assert np.abs(np.array(adapted.result().vectors) - tuned).max() <= ALIKE
        assert _cosines(np.array(base.result().vectors), references["last"]).min() >= 0.9999
        with pytest.raises(GenerationError, match="no LoRA adapter named 'nope'"):
            client.embed(TEXTS[0], lora_adapter="nope")
    out = subprocess.run(
        [*PAGEDSERVE, "embed", TEXTS[0], "--lora-adapter", "tuned", "--target", stack.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["model"] == "tuned"
    assert np.abs(np.array(printed["embeddings"][0]) - tuned[0]).max() <= ALIKE
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        _api(stack).embeddings.create(model="nope", input="hi")
