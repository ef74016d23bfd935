"""Multi-LoRA through `pagedserve up` (docs/adapters.md): three PEFT adapters of different ranks and targets
named at start (--lora-modules), requested beside the base model in one concurrent batch, prompts prefilled
in chunks, give peft's PeftModel greedy tokens, on Llama (fused layers, native decode stack for base steps)
and Phi-3 (transformers' layers, fused QKV and gate/up targets); prefix hits stay within one adapter; the
OpenAI API names adapters by `model` (responses too) and lists them with their parent; prompt
log-probabilities (echo, prompt_logprobs, gRPC) are the adapter's, as peft's; adapters load and unload at
run time; bad adapters and unknown names are refused, nothing else changed."""

import contextlib
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from protos import compute_pb2
from sdk.client import GenerationError
from tests.e2e.greedy import hf_greedy
from tests.e2e.stack import start_stack
from tests.lora_adapters import LLAMA_ATTENTION, LLAMA_MLP, peft_model, save_tiny_with_adapters

pytestmark = pytest.mark.e2e

NEW_TOKENS = 6
TOL = 1e-4  # float32 log-probabilities against peft's, per token
# A step's budget below every prompt: each is prefilled in chunks (beside the others' decodes).
FLAGS = (
    *("--dtype", "float32", "--kv-blocks", "128", "--block-size", "8", "--max-batched-tokens", "24"),
    *("--max-loras", "4", "--max-lora-rank", "8"),
    # a chat of digits and punctuation renders inside the tiny models' 256 token ids
    *("--chat-template", "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>\n{% endfor %}"),
)
# per architecture: name -> (rank, targets, rsLoRA); the fourth is loaded at run time
ADAPTERS = {
    "llama3-rope": {
        "sql": (4, ["q_proj", "v_proj"], False),
        "chat": (8, LLAMA_ATTENTION + LLAMA_MLP, True),
        "code": (2, ["o_proj", "gate_proj", "down_proj"], False),
        "late": (8, ["k_proj", "up_proj"], False),
    },
    "phi3": {
        "sql": (4, ["qkv_proj"], False),
        "chat": (8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True),
        "code": (2, ["down_proj", "o_proj"], False),
        "late": (8, ["gate_up_proj"], False),
    },
}
_generator = torch.Generator().manual_seed(17)
# The API's tests run on one architecture: what they check is the gateway's.
LLAMA_ONLY = pytest.mark.parametrize("served", ["llama3-rope"], indirect=True)
# a chat message of the tiny models' token ids (digits and punctuation)
CHAT = "1,2,3,4,5,6,7,8,9;0.1:2"
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (41, 33, 57, 29)]


@pytest.fixture(scope="module", params=list(ADAPTERS))
def served(request, tmp_path_factory, tokenizer, logs):
    """(stack, adapter directories, peft's model with every adapter)."""
    root = tmp_path_factory.mktemp("lora")
    model_dir, paths = save_tiny_with_adapters(root, request.param, tokenizer, ADAPTERS[request.param])
    modules = [f"{name}={paths[name]}" for name in ("sql", "chat", "code")]
    stack = start_stack(logs, "--model", str(model_dir), *FLAGS, "--lora-modules", *modules)
    yield stack, paths, peft_model(model_dir, paths)
    assert stack.stop() == 0


def _reference(model, adapter: str, prompt: list[int]) -> list[int]:
    if not adapter:
        with model.disable_adapter():
            return hf_greedy(model, prompt, NEW_TOKENS)
    model.set_adapter(adapter)
    return hf_greedy(model, prompt, NEW_TOKENS)


def _generate(client, prompt: list[int], adapter: str):
    return client.generate(
        token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_adapter=adapter
    )


def test_base_and_three_adapters_in_one_batch_give_peft_tokens(served):
    stack, _, reference = served
    rows = list(zip(PROMPTS, ["", "sql", "chat", "code"], strict=True))
    with stack.client() as client, ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda row: _generate(client, *row), rows))
    for (prompt, adapter), result in zip(rows, results, strict=True):
        assert result.token_ids == _reference(reference, adapter, prompt), adapter or "base"
    assert len({tuple(result.token_ids) for result in results}) == len(rows), "each adapter changes tokens"


def test_model_info_lists_the_adapters_and_the_plan_their_path(served):
    stack, _, _ = served
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    assert [(a.name, a.rank) for a in info.lora_adapters] == [("sql", 4), ("chat", 8), ("code", 2)]
    assert (info.lora_limits.max_loras, info.lora_limits.max_lora_rank) == (4, 8)
    stages = {stage.stage: stage.implementation for stage in info.execution_plan.stages}
    assert stages["lora"] == f"segmented shrink/expand on the {stages['layers']} layers"


def test_prefix_hits_stay_within_an_adapter(served):
    stack, _, reference = served
    first, again = PROMPTS[2], PROMPTS[2][:32] + PROMPTS[0][:9]
    with stack.client() as client:
        _generate(client, first, "chat")
        hits = stack.stats().prefix_hit_tokens
        other = _generate(client, again, "code")
        assert stack.stats().prefix_hit_tokens == hits, "another adapter's blocks are not this one's KV"
        same = _generate(client, again, "chat")
        assert stack.stats().prefix_hit_tokens >= hits + 32, "the adapter's own 32 tokens are read"
    assert other.token_ids == _reference(reference, "code", again)
    assert same.token_ids == _reference(reference, "chat", again)


@LLAMA_ONLY
def test_openai_names_adapters_by_model_and_lists_them(served):
    stack, paths, reference = served
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300) as client:
        listed = {card.id: card.model_dump() for card in client.models.list().data}
        base = next(name for name, card in listed.items() if card.get("parent") is None)
        assert {name: listed[name]["parent"] for name in ("sql", "chat", "code")} == dict.fromkeys(
            ("sql", "chat", "code"), base
        )
        assert listed["sql"]["root"] == str(paths["sql"])
        completion = client.completions.create(
            model="sql",
            prompt=PROMPTS[1],
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            client.completions.create(model="nope", prompt=PROMPTS[1], max_tokens=1)
    assert completion.model == "sql"
    assert completion.choices[0].model_dump()["token_ids"] == _reference(reference, "sql", PROMPTS[1])


@LLAMA_ONLY
def test_responses_name_adapters_by_model(served):
    """/v1/responses runs the adapter `model` names, as chat completions do, and names it in the response."""
    stack, _, _ = served
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300) as client:
        base = client.models.list().data[0].id
        texts = {}
        for model in ("chat", base):
            response = client.responses.create(model=model, input=CHAT, max_output_tokens=16, temperature=0.0)
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": CHAT}], max_tokens=16, temperature=0.0
            )
            assert response.output_text == chat.choices[0].message.content, model
            assert response.model == chat.model == model
            texts[model] = response.output_text
    assert texts["chat"] != texts[base], "the adapter changes the reply"


@LLAMA_ONLY
def test_an_unknown_adapter_is_refused_by_name(served):
    stack, _, _ = served
    with (
        stack.client() as client,
        pytest.raises(GenerationError, match="no LoRA adapter named 'nope'") as err,
    ):
        _generate(client, PROMPTS[0], "nope")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@LLAMA_ONLY
def test_adapters_load_and_unload_at_run_time(served):
    stack, paths, reference = served
    assert _post(stack, "load_lora_adapter", lora_name="late", lora_path=str(paths["late"])) == 200
    with stack.client() as client:
        assert "late" in [adapter.name for adapter in client.info().lora_adapters]
        loaded = _generate(client, PROMPTS[3], "late")
        assert _post(stack, "unload_lora_adapter", lora_name="late") == 200
        with pytest.raises(GenerationError, match="no LoRA adapter named 'late'"):
            _generate(client, PROMPTS[3], "late")
        assert [adapter.name for adapter in client.info().lora_adapters] == ["sql", "chat", "code"]
    assert loaded.token_ids == _reference(reference, "late", PROMPTS[3])


@LLAMA_ONLY
def test_bad_loads_are_refused_and_change_nothing(served, tmp_path):
    stack, paths, _ = served
    assert _post(stack, "load_lora_adapter", lora_name="sql", lora_path=str(paths["late"])) == 400
    assert _post(stack, "load_lora_adapter", lora_name="x", lora_path=str(tmp_path)) == 400
    assert _post(stack, "unload_lora_adapter", lora_name="never") == 404
    with stack.client() as client:
        assert [adapter.name for adapter in client.info().lora_adapters] == ["sql", "chat", "code"]


def _post(stack, route: str, **body) -> int:
    request = urllib.request.Request(
        f"{stack.http_url}/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


@LLAMA_ONLY
def test_prompt_logprobs_are_the_adapters_on_every_path(served):
    """echo with logprobs and vLLM's prompt_logprobs (completions and chat) over HTTP and prompt_logprobs over
    gRPC score the prompt through the adapter `model` names: peft's float32 log-softmax within 1e-4 per
    token, not the base model's."""
    stack, _, reference = served
    prompt, messages = PROMPTS[1], [{"role": "user", "content": CHAT}]
    chat_prompt = _post_json(stack, "/tokenize", {"model": "chat", "messages": messages})["tokens"]
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300) as client:
        echoed = client.completions.create(
            model="chat", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0.0
        )
    vllm = _post_json(stack, "/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 0,
                                                 "prompt_logprobs": 0})  # fmt: skip
    chat = _post_json(stack, "/v1/chat/completions", {"model": "chat", "messages": messages, "max_tokens": 1,
                                                      "prompt_logprobs": 0})  # fmt: skip
    with stack.client() as client:
        scored = {
            adapter: client.generate(token_ids=prompt, max_tokens=0, prompt_logprobs=0, lora_adapter=adapter)
            for adapter in ("chat", "")
        }
    expected = _prompt_logprobs(reference, "chat", prompt)
    got = {
        "echo": echoed.choices[0].logprobs.token_logprobs[1:],
        "prompt_logprobs": _own(vllm["choices"][0]["prompt_logprobs"], prompt),
        "grpc": [lp.logprob for lp in scored["chat"].prompt_logprobs],
    }
    for path, logprobs in got.items():
        torch.testing.assert_close(
            torch.tensor(logprobs), expected, atol=TOL, rtol=0, msg=lambda m, path=path: f"{path}: {m}"
        )
    chat_logprobs = torch.tensor(_own(chat["prompt_logprobs"], chat_prompt))
    expected_chat = _prompt_logprobs(reference, "chat", chat_prompt)
    torch.testing.assert_close(chat_logprobs, expected_chat, atol=TOL, rtol=0)
    base = _prompt_logprobs(reference, "", prompt)
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in scored[""].prompt_logprobs]), base, atol=TOL, rtol=0
    )
    assert (expected - base).abs().max() > 100 * TOL, "the adapter changes the prompt's log-probabilities"
    assert echoed.model == vllm["model"] == chat["model"] == "chat"


def _prompt_logprobs(model, adapter: str, prompt: list[int]) -> torch.Tensor:
    """peft's float32 log-probability of each prompt token after the first, given those before it."""
    if adapter:
        model.set_adapter(adapter)
    with torch.inference_mode(), contextlib.nullcontext() if adapter else model.disable_adapter():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def _own(entries: list[dict | None], prompt: list[int]) -> list[float]:
    """Each prompt token's own log-probability in vLLM's prompt_logprobs (none for the first)."""
    assert entries[0] is None and len(entries) == len(prompt)
    return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], prompt[1:], strict=True)]


def _post_json(stack, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        stack.http_url.removesuffix("/v1") + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as err:
        pytest.fail(f"{path}: {err.code} {err.read().decode()}")
