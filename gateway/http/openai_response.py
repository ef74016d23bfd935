"""The gateway's GenerateResponses as OpenAI objects: whole completions and chat completions, their
streamed chunks (server-sent events), usage and logprobs."""

import json
import time
from collections import defaultdict
from collections.abc import Sequence

from gateway.http.prompt_echo import PromptEcho
from gateway.resume import finished_tokens
from protos import generation_pb2

FINISH = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
DONE = "data: [DONE]\n\n"


def event(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Rendering:
    """One request's responses rendered for completions (`chat` False) or chat completions: per reply a
    streamed chunk, or all of them as one object; usage counted as they pass (each prompt's once).
    `prompts` shows the prompts (echo, prompt logprobs; gateway.http.prompt_echo); a choice's prompt is
    its index // n.

    `token_ids` (return_token_ids): each choice carries its token ids too. A resumed request's (`resumed`:
    GenerateRequest.resume) choices continue the broken stream's: no second assistant role, logprobs'
    text offsets after the received text, and the usage counts the choices finished before.
    """

    def __init__(
        self,
        chat: bool,
        model: str,
        tokenizer,
        token_ids: bool = False,
        resumed: Sequence[generation_pb2.ResumedSample] = (),
        n: int = 1,
        prompts: PromptEcho | None = None,
    ) -> None:
        self.chat = chat
        # The gateway's id of the request, from its first reply.
        self.request_id = ""
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._token_ids = token_ids
        self._resumed = {sample.index: sample.token_ids for sample in resumed}
        self._text_offsets: dict[int, int] = {}
        self._started = {sample.index for sample in resumed if sample.token_ids or sample.finished}
        # Tool calls streamed so far, per sample (a streamed call's index).
        self._calls: dict[int, int] = defaultdict(int)
        self._n = n
        self.prompts = prompts or PromptEcho(tokenizer, n)
        # per prompt: its tokens and those of them the cache held
        self._prompt_tokens: dict[int, tuple[int, int]] = {}
        self._completion_tokens = finished_tokens(resumed)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def count(self, reply: generation_pb2.GenerateResponse) -> None:
        """Notes the request id; adds a sample's last reply's usage (prompt counted once, completion tokens
        of every sample)."""
        self.request_id = self.request_id or reply.request_id
        self.prompts.note(reply)
        if reply.finish_reason:
            usage = reply.usage
            self._prompt_tokens[reply.index // self._n] = (usage.prompt_tokens, usage.cached_tokens)
            self._completion_tokens += usage.completion_tokens

    def usage(self) -> dict:
        prompt = sum(tokens for tokens, _ in self._prompt_tokens.values())
        completion = self._completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in self._prompt_tokens.values())},
        }

    # streamed
    def chunk(self, reply: generation_pb2.GenerateResponse, with_usage: bool) -> dict | None:
        """The chunk of one reply, None when it carries nothing to tell (a token whose text is held back
        for a stop string, without logprobs); `usage: null` in each when the last chunk will carry it."""
        self.count(reply)
        first = reply.index not in self._started
        self._started.add(reply.index)
        tokens = self._token_ids and reply.token_ids
        shows_prompt = first and bool(self.prompts.text(reply.index) or self.prompts.vllm(reply.index))
        if not (
            reply.text or tokens or reply.logprobs or reply.finish_reason or reply.tool_calls
            or reply.reasoning_text or (self.chat and first) or shows_prompt
        ):  # fmt: skip
            return None
        choice = {"index": reply.index}
        if self.chat:
            choice["delta"] = {"role": "assistant"} if first else {}
            if reply.text or not reply.reasoning_text:
                choice["delta"]["content"] = reply.text
            if reply.reasoning_text:
                choice["delta"]["reasoning_content"] = reply.reasoning_text
            if reply.tool_calls:
                start = self._calls[reply.index]
                self._calls[reply.index] += len(reply.tool_calls)
                choice["delta"]["tool_calls"] = [
                    {"index": start + i, **_call(call)} for i, call in enumerate(reply.tool_calls)
                ]
        else:
            choice["text"] = self.prompts.text(reply.index) + reply.text if first else reply.text
        if self._token_ids:
            choice["token_ids"] = list(reply.token_ids)
        choice["logprobs"] = self._logprobs(reply, first) if reply.logprobs or first else None
        choice["finish_reason"] = FINISH.get(reply.finish_reason)
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if first:
            self._prompt_logprobs(chunk, choice, reply.index)
        if with_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the request's usage."""
        chunk = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = self.usage()
        return chunk

    # whole
    def whole(self, replies: list[generation_pb2.GenerateResponse], logprobs: bool) -> dict:
        """The response object of all the replies (of every sample), choices in sample order."""
        by_index: dict[int, list] = defaultdict(list)
        for reply in replies:
            self.count(reply)
            by_index[reply.index].append(reply)
        choices = [self._choice(index, by_index[index], logprobs) for index in sorted(by_index)]
        whole = self._object("chat.completion" if self.chat else "text_completion", choices)
        for choice in choices:
            self._prompt_logprobs(whole, choice, choice["index"])
        whole["usage"] = self.usage()
        return whole

    def _prompt_logprobs(self, response: dict, choice: dict, index: int) -> None:
        """vLLM's prompt_logprobs, when asked: on each completions choice; on a chat response (its one
        prompt's)."""
        entries = self.prompts.vllm(index)
        if entries is not None:
            (response if self.chat else choice)["prompt_logprobs"] = entries

    def _choice(self, index: int, replies: list, logprobs: bool) -> dict:
        text = "".join(reply.text for reply in replies)
        choice = {"index": index}
        if self.chat:
            calls = [_call(call) for reply in replies for call in reply.tool_calls]
            choice["message"] = {"role": "assistant", "content": None if calls and not text.strip() else text}
            reasoning = "".join(reply.reasoning_text for reply in replies)
            if reasoning:
                choice["message"]["reasoning_content"] = reasoning
            if calls:
                choice["message"]["tool_calls"] = calls
        else:
            choice["text"] = self.prompts.text(index) + text
        if self._token_ids:
            choice["token_ids"] = [t for reply in replies for t in reply.token_ids]
        choice["logprobs"] = None
        if logprobs:
            parts = [self._logprobs(reply, i == 0) for i, reply in enumerate(replies)]
            parts = [part for part in parts if part is not None]
            choice["logprobs"] = {key: [v for part in parts for v in part[key]] for key in self._keys()}
        choice["finish_reason"] = FINISH.get(replies[-1].finish_reason)
        return choice

    # logprobs
    def _keys(self) -> tuple[str, ...]:
        return ("content",) if self.chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _logprobs(self, reply: generation_pb2.GenerateResponse, first: bool = False) -> dict | None:
        """The reply's tokens' logprobs: chat's `{"content": [...]}`, or completions' four lists, after its
        prompt's on a choice's `first` reply with echo; None when there are none."""
        echoed = not self.chat and first and self.prompts.echoes_logprobs(reply.index)
        if not (reply.logprobs or echoed):
            return None
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in reply.logprobs]}
        tokens = [self._token(lp.token_id) for lp in reply.logprobs]
        if reply.index not in self._text_offsets:
            received = self._resumed.get(reply.index, ())
            self._text_offsets[reply.index] = sum(len(self._token(t)) for t in received)
            if echoed:
                self._text_offsets[reply.index] += self.prompts.text_length(reply.index)
        offsets = []
        for token in tokens:
            offsets.append(self._text_offsets[reply.index])
            self._text_offsets[reply.index] += len(token)
        lists = {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in reply.logprobs],
            "top_logprobs": [
                {self._token(t): p for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
                for lp in reply.logprobs
            ],
            "text_offset": offsets,
        }
        if echoed:
            prompt = self.prompts.logprobs(reply.index)
            lists = {key: prompt[key] + values for key, values in lists.items()}
        return lists

    def _chat_logprob(self, lp: generation_pb2.TokenLogprobs) -> dict:
        entry = self._chat_token(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [
            self._chat_token(t, p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ]
        return entry

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _call(call: generation_pb2.ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
