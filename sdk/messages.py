"""The SDK's view of the public API's responses: each a `Chunk`, a sample's gathered into a `Completion`."""

from dataclasses import dataclass, field

from protos import generation_pb2

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (raw model logits) and the `logprobs` (`prompt_logprobs` for a prompt
    token) most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, log-probability), most likely first
    top: list[tuple[int, float]]
    # A prompt token's rank among all tokens at its position (1: the most likely); 0 for generated ones.
    rank: int = 0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # JSON text
    arguments: str


@dataclass(frozen=True)
class Timings:
    """Seconds from the request's arrival at the gateway: until its first step, its first token, its end."""

    queue_s: float
    time_to_first_token_s: float
    total_s: float


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the new tokens and text; the last one has finish_reason and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # Which of the n samples the chunk continues.
    index: int = 0
    # One per token when the request set logprobs.
    logprobs: list[TokenLogprob] | None = None
    timings: Timings | None = None
    # With tools: the calls this chunk completed.
    tool_calls: list[ToolCall] = field(default_factory=list)
    # How often the request's stream broke and went on (resumed) before this chunk (sdk.resume).
    resumes: int = 0
    # A reasoning model's: the reasoning text of this chunk (`text` is the answer's; docs/reasoning.md).
    reasoning_text: str = ""
    # With prompt_logprobs, on sample 0's first chunk (of each prompt): the prompt's ids, and a score per
    # prompt token after the first.
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: Timings | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    resumes: int = 0
    reasoning_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


def to_chunk(response: generation_pb2.GenerateResponse, resumes: int = 0) -> Chunk:
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
    timings = None
    if response.HasField("timings"):
        t = response.timings
        timings = Timings(t.queue_s, t.time_to_first_token_s, t.total_s)
    return Chunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=usage,
        index=response.index,
        logprobs=[_logprob(lp) for lp in response.logprobs] or None,
        timings=timings,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in response.tool_calls],
        resumes=resumes,
        reasoning_text=response.reasoning_text,
        prompt_token_ids=list(response.prompt_token_ids),
        prompt_logprobs=[_logprob(lp) for lp in response.prompt_logprobs]
        if response.prompt_token_ids
        else None,
    )


def _logprob(lp: generation_pb2.TokenLogprobs) -> TokenLogprob:
    top = list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))
    return TokenLogprob(lp.token_id, lp.logprob, top, lp.rank)


def add(result: Completion, chunk: Chunk) -> None:
    """Adds a chunk of one sample to its completion."""
    result.request_id = chunk.request_id
    result.token_ids.extend(chunk.token_ids)
    result.text += chunk.text
    result.reasoning_text += chunk.reasoning_text
    result.tool_calls.extend(chunk.tool_calls)
    result.finish_reason, result.usage, result.timings = chunk.finish_reason, chunk.usage, chunk.timings
    result.resumes = chunk.resumes
    if chunk.prompt_logprobs is not None:
        result.prompt_token_ids, result.prompt_logprobs = chunk.prompt_token_ids, chunk.prompt_logprobs
    if chunk.logprobs is not None:
        result.logprobs = result.logprobs or []
        result.logprobs.extend(chunk.logprobs)
