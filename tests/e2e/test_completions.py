"""Completions as OpenAI and vLLM define them, against the real stack (the float32 model, prompts in 40-token
chunks): lists of prompts, echo, max_tokens 0 and prompt log-probabilities equal to transformers' own float32
log_softmax within 1e-4 per token (a prompt the prefix cache holds included), over HTTP (the `openai` client,
raw JSON) and gRPC (the SDK and the CLI); /tokenize and /detokenize; --chat-template and
--served-model-name; each new field's bad values refused with a 400 naming it, nothing else changed."""

import json
import subprocess
import urllib.error
import urllib.request

import openai
import pytest
import torch

from tests.e2e.conftest import SCORING_NAMES
from tests.helpers import PAGEDSERVE

pytestmark = pytest.mark.e2e
# Over two 40-token chunks: scored in three steps.
LONG = "In a small village by the sea, an old fisherman told the children a story every evening. " * 3
SHORT = "The capital of France is"
TOL = 1e-4


@pytest.fixture(scope="module")
def api(stack_scoring):
    with openai.OpenAI(base_url=stack_scoring.http_url, api_key="-", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def hf_logprobs(hf_models):
    """[len(ids) - 1, V]: transformers' float32 log_softmax at each prompt position (predicting the next)."""

    def scores(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_models(torch.float32)(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)

    return scores


def chosen(expected: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Each prompt token's log-probability (after the first) in transformers' [len(ids) - 1, V]."""
    return expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def close(got, want) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=TOL, rtol=0)


def post(stack, path: str, body: object) -> tuple[int, dict]:
    """POST JSON to the stack's HTTP root (status, JSON reply)."""
    url = stack.http_url.removesuffix("/v1") + path
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_echo_logprobs_of_a_prompt_list_equal_transformers_a_cached_prompt_too(stack_scoring, api, tokenizer,
                                                                                hf_logprobs):  # fmt: skip
    # LONG first without prompt logprobs: its blocks are in the prefix cache when it is scored below
    warm = api.completions.create(model="smol", prompt=LONG, max_tokens=1, temperature=0)
    again = api.completions.create(model="smol", prompt=LONG, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the prompt is cached"
    ids = [tokenizer.encode(LONG), tokenizer.encode(SHORT)]
    whole = api.completions.create(
        model="smol", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    assert whole.usage.prompt_tokens_details.cached_tokens == 0, "a scored prompt is computed whole"
    assert whole.usage.prompt_tokens == sum(map(len, ids))
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].text == LONG + warm.choices[0].text, "echo: the prompt (decoded), the completion"
    assert whole.choices[1].text.startswith(SHORT)
    for choice, prompt in zip(whole.choices, ids, strict=True):
        expected = hf_logprobs(prompt)
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
        got = torch.tensor(logprobs.token_logprobs[1 : len(prompt)])
        chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, chosen, atol=TOL, rtol=0)
        top = expected.topk(2)
        for position, alternatives in enumerate(logprobs.top_logprobs[1 : len(prompt)]):
            pairs = zip(top.indices[position].tolist(), top.values[position].tolist(), strict=True)
            want = {tokenizer.decode([t]): v for t, v in pairs}
            assert alternatives.keys() == want.keys()
            torch.testing.assert_close(list(alternatives.values()), list(want.values()), atol=TOL, rtol=0)
        offsets = logprobs.text_offset
        assert offsets == sorted(offsets) and offsets[0] == 0


def test_vllm_prompt_logprobs_on_completions_and_chat(stack_scoring, tokenizer, hf_logprobs):
    ids = tokenizer.encode(SHORT)
    status, reply = post(
        stack_scoring, "/v1/completions", {"prompt": SHORT, "max_tokens": 0, "prompt_logprobs": 3}
    )
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert (
        choice["text"] == ""
        and choice["finish_reason"] == "length"
        and reply["usage"]["completion_tokens"] == 0
    )
    entries, expected = choice["prompt_logprobs"], hf_logprobs(ids)
    assert entries[0] is None and len(entries) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:], strict=True)):
        own = entry[str(token)]
        assert abs(own["logprob"] - expected[position, token].item()) < TOL
        assert own["rank"] == int((expected[position] >= expected[position, token]).sum())
        top = expected[position].topk(3).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3] and set(entry) == {
            str(token),
            *map(str, top),
        }
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = post(stack_scoring, "/v1/chat/completions",
                        {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0})  # fmt: skip
    assert status == 200, chat
    _, rendered = post(stack_scoring, "/tokenize", {"messages": messages})
    chat_ids, chat_expected = rendered["tokens"], hf_logprobs(rendered["tokens"])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] == len(chat_ids)
    got = [chat["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(chat_ids) if i]
    close(got, chosen(chat_expected, chat_ids))


def test_each_prompt_gets_n_choices_in_order_equal_to_its_own_request(api):
    prompts = ["One, two,", "Red, green,", "The capital of"]
    batch = api.completions.create(model="smol", prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = api.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0)
        assert [c.text for c in batch.choices[2 * p : 2 * p + 2]] == [alone.choices[0].text] * 2
    streamed = list(api.completions.create(model="smol", prompt=prompts[:2], max_tokens=3, temperature=0,
                                           echo=True, stream=True))  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {
        i: prompts[i] + batch.choices[2 * i].text[: len(texts[i]) - len(prompts[i])] for i in (0, 1)
    }
    echoed = api.completions.create(model="smol", prompt=SHORT, max_tokens=0, echo=True)
    assert echoed.choices[0].text == SHORT and echoed.usage.completion_tokens == 0


def test_grpc_sdk_and_cli_score_prompts_and_run_batches(stack_scoring, tokenizer, hf_logprobs):
    ids = tokenizer.encode(SHORT)
    with stack_scoring.client(timeout=120) as client:
        scored = client.generate(SHORT, max_tokens=0, prompt_logprobs=2)
        batch = client.generate_batch([SHORT, ids], n=2, max_tokens=3, temperature=0)
        tokenized = client.tokenize(SHORT, return_token_strs=True)
        text = client.detokenize(ids)
        assert client.info().model == SCORING_NAMES[0]
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.prompt_token_ids == ids
    expected = hf_logprobs(ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    close([lp.logprob for lp in scored.prompt_logprobs], expected)
    assert all(len(lp.top) == 2 and lp.rank >= 1 for lp in scored.prompt_logprobs)
    assert len({c.text for c in batch}) == 1 and len(batch) == 4, "one prompt as text and as ids, greedy"
    assert list(tokenized.token_ids) == ids and list(tokenized.token_strs) == tokenizer.convert_ids_to_tokens(
        ids
    )
    assert text == SHORT
    out = subprocess.run(
        [*PAGEDSERVE, "generate", SHORT, "--max-tokens", "0", "--prompt-logprobs", "1",
         "--target", stack_scoring.target], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line.split("\t") for line in out.stderr.splitlines() if line.startswith("prompt\t")]
    assert [int(line[1]) for line in lines] == ids[1:]
    assert all(abs(float(line[2]) - e) < 1e-3 for line, e in zip(lines, expected.tolist(), strict=True))


def test_tokenize_detokenize_chat_template_and_served_names(stack_scoring, tokenizer):
    status, plain = post(
        stack_scoring, "/tokenize", {"model": "smol-alias", "prompt": SHORT, "return_token_strs": True}
    )
    assert (
        status == 200
        and plain["tokens"] == tokenizer.encode(SHORT)
        and plain["count"] == len(plain["tokens"])
    )
    assert (
        plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
        and plain["max_model_len"] == 8192
    )
    status, chat = post(stack_scoring, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "add_generation_prompt": False})  # fmt: skip
    assert status == 200 and tokenizer.decode(chat["tokens"]) == "<user>Hi\n", "--chat-template renders chats"
    assert post(stack_scoring, "/detokenize", {"tokens": plain["tokens"]}) == (200, {"prompt": SHORT})
    models = json.load(urllib.request.urlopen(stack_scoring.http_url + "/models", timeout=30))
    assert [m["id"] for m in models["data"]] == [SCORING_NAMES[0]]
    assert post(stack_scoring, "/v1/completions", {"model": "smollm2", "prompt": "x"})[0] == 404


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "must be in [0, 20]"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "must be in [0, 20]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", "must be >= 0"),
        ("/v1/completions", {"prompt": []}, "prompt", "prompt is an empty list"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt", "prompt[1] is empty"),
        ("/v1/completions", {"prompt": [[1], "a"]}, "prompt", "prompt must be a string"),
        ("/v1/completions", {"prompt": ["a"] * 65}, "prompt", "the limit is 64 (--max-prompts)"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "valid boolean"),
        ("/v1/completions", {"prompt": "x", "echo": True, "resume": [{"index": 0}]}, "echo", "echo cannot"),
        (
            "/v1/chat/completions",
            {"messages": [], "prompt_logprobs": "2"},
            "prompt_logprobs",
            "valid integer",
        ),
        ("/tokenize", {"prompt": "x", "messages": []}, "prompt", "unsupported parameter 'prompt'"),
        ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unsupported"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens", "token id 49152 is outside the vocabulary"),
        ("/detokenize", {"tokens": "ab"}, "tokens", "valid list"),
    ],
)
def test_bad_values_of_each_new_field_are_400_naming_it(stack_scoring, path, body, param, says):
    status, reply = post(stack_scoring, path, body)
    assert status == 400, reply
    assert says in reply["error"]["message"] and reply["error"]["param"] == param, reply
    assert stack_scoring.stats().num_sequences == 0


def test_a_body_nested_too_deep_is_400_on_every_route_before_it_is_parsed(stack_scoring, api):
    before = api.completions.create(model="smol", prompt=SHORT, max_tokens=4, temperature=0).choices[0].text
    schema = '{"type":"array","items":' * 2000 + "{}" + "}" * 2000
    chat = '{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",' \
           '"json_schema":{"name":"a","schema":' + schema + "}}}"  # fmt: skip
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/anything"):
        status, reply = post(stack_scoring, path, chat.encode())
        assert status == 400 and reply["error"]["code"] == "request_too_deep", (path, reply)
        assert "2004 levels deep; the limit is 64 (--max-request-depth)" in reply["error"]["message"]
    after = api.completions.create(model="smol", prompt=SHORT, max_tokens=4, temperature=0).choices[0].text
    assert after == before and stack_scoring.stats().num_sequences == 0
