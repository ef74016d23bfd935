"""One generation path for every public front (gRPC Generate, the OpenAI-compatible HTTP API): a
GenerateRequest and its caller in, GenerateResponses out, through the same checks, limits, stream slots,
admission gate and engine."""

import queue
import threading
import uuid
from collections.abc import Callable, Iterator

import structlog

from common.errors import InvalidArgument, ResourceExhausted, Unavailable
from gateway import metrics, prompt_batch, resume, sparse_request, token_ids, vision
from gateway import tokenizer as tok
from gateway.admission import Admission
from gateway.auth import Tenant, salted
from gateway.chat_formats import ChatFormats
from gateway.edge import Edge
from gateway.engine import Engine
from gateway.limits import check_queue, check_request, check_request_id
from gateway.lora import LoraAdapters
from gateway.reasoning import formats as reasoning_formats
from gateway.reasoning.constraint import after_reasoning
from gateway.reasoning.stream import ReasoningStreams
from gateway.sampling import resolve_sampling
from gateway.sequence import Sequence
from gateway.started import OnEnd, Started
from gateway.streams import StreamSlots
from gateway.structured import spec as constraint_spec
from gateway.structured.grammars import Grammars
from gateway.structured.matcher import Matcher
from gateway.tools import request as tool_request
from gateway.tools.stream import CallStreams
from protos import generation_pb2

log = structlog.get_logger()
# The prompt's last tokens in which a template's opening of the reasoning is looked for.
PROMPT_TAIL_TOKENS = 32


class Generation:
    """What a front needs: the attached model, and `stream` to serve one request."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        admission: Admission,
        slots: StreamSlots,
        edge: Edge,
        grammars: Grammars,
        formats: ChatFormats,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.admission = admission
        self.slots = slots
        self.edge = edge
        self.grammars = grammars
        self.formats = formats
        # --served-model-name: the names requests may give; the first is the one responses carry.
        self.served_names: tuple[str, ...] = ()
        self.adapters = LoraAdapters(engine)
        # A vision-language model's processor (gateway.vision; None: a text model, images refused).
        self.images: vision.ImageInputs | None = None

    def model_name(self, info) -> str:
        """The name responses carry: the first --served-model-name, else the attached model's."""
        return self.served_names[0] if self.served_names else info.model

    def attached_model(self):
        """The model info of the attached compute; Unavailable while the gateway is still attaching."""
        if self.engine.model_info is None:
            raise Unavailable(
                "the gateway is still attaching to the cache and compute services; retry shortly"
            )
        return self.engine.model_info

    def tokenize(self, request: generation_pb2.TokenizeRequest) -> generation_pb2.TokenizeResponse:
        """The request's token ids as `stream` would encode them (gateway.token_ids)."""
        info = self.attached_model()
        return token_ids.tokenize(self.tokenizer, request, info, self.edge.limits, self.grammars.limits)

    def detokenize(self, request: generation_pb2.DetokenizeRequest) -> generation_pb2.DetokenizeResponse:
        info = self.attached_model()
        return token_ids.detokenize(self.tokenizer, request, info.vocab_size, info.max_model_len)

    def stream(
        self, request: generation_pb2.GenerateRequest, tenant: Tenant, on_end: OnEnd
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """One response per token (of each of the n samples, of each prompt); ends at finish, or raises the
        request's error.

        The request id (the request's, else the `request_id` bound in the log context, else a new one) is in
        every response and in the gateway, cache and compute logs of the steps that serve it. Refused at
        once: RESOURCE_EXHAUSTED beyond --max-streams concurrent streams (--max-streams-per-key of one key)
        or a full queue, INVALID_ARGUMENT beyond a limit. `on_end` callbacks abort the sequences (freeing
        their blocks) and release their admission when the call ends early (cancel, deadline, disconnect).
        A request of several prompts (GenerateRequest.prompts) runs them all at once, each checked before any
        starts (gateway.prompt_batch).
        """
        with self.slots.hold(), self.edge.stream_slot(tenant):
            request_id = self._request_id(request)
            parts = prompt_batch.split(request, self.edge.limits.max_prompts)
            started = [self._prepare(part, request_id, tenant) for part in parts]
            if len(started) == 1:
                started[0].submit(self, on_end)
                yield from started[0].replies()
                return
            outbox = queue.Queue()
            for number, part in enumerate(started):
                part.submit(self, on_end, prompt_batch.Tagged(outbox, number))
            yield from prompt_batch.merged(started, outbox)

    def count_prompt(self, request: generation_pb2.GenerateRequest) -> int:
        """The tokens of the request's prompt as Generate renders it (chat template, tools, template
        variables), under the same checks; nothing is generated."""
        info = self.attached_model()
        check_request(request, self.edge.limits, info.max_model_len)
        limits = self.grammars.limits
        tools = tool_request.from_request(
            request, limits.max_tools, limits.max_constraint_bytes, limits.max_constraint_depth
        )
        return len(tok.encode(self.tokenizer, request, info.vocab_size, tools))

    def _request_id(self, request: generation_pb2.GenerateRequest) -> str:
        """The request's id (see `stream`), bound to the log context; INVALID_ARGUMENT if too long."""
        request_id = request.request_id or structlog.contextvars.get_contextvars().get("request_id")
        check_request_id(request_id or "", self.edge.limits)
        if request.resume and not request_id:
            raise InvalidArgument("resume needs the request_id its responses carried: the one to continue")
        request_id = request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        return request_id

    def _prepare(self, request, request_id: str, tenant: Tenant) -> Started:
        """One prompt's sequences, checked and made, not yet submitted."""
        info = self.attached_model()
        check_request(request, self.edge.limits, info.max_model_len)
        if request.resume and request.sampling.HasField("prompt_logprobs"):
            raise InvalidArgument(
                "sampling.prompt_logprobs cannot be combined with resume: the first stream carried them"
            )
        seq, tools, reasoning = self._new_sequence(request, request_id, tenant, info)
        resumed = resume.samples(
            seq, request.resume, frozenset(info.eos_token_ids), self.tokenizer, info.vocab_size
        )
        received = resumed.texts
        if reasoning is not None:
            reasoning = ReasoningStreams(self.formats.reasoning, reasoning, received)
            received = reasoning.answers
        calls = CallStreams(tools, self.formats.tools, received) if tools is not None else None
        timer = metrics.RequestTimer(info.model)
        return Started(seq, resumed, reasoning, calls, timer, bool(request.resume))

    def _new_sequence(
        self, request: generation_pb2.GenerateRequest, request_id: str, tenant: Tenant, info
    ) -> tuple[Sequence, tool_request.ToolUse | None, bool | None]:
        """The request's sequence, tools, and (with a reasoning format, for chat messages) whether its prompt
        opened the reasoning (None: its text is not split); refused before tokenizing if the queue is full or
        a control is bad, before compiling its constraint if the prompt is."""
        limits = self.grammars.limits
        if info.pooling.source == "score":
            raise InvalidArgument(
                f"model {info.model} is served as a scoring model: it serves scores (POST /v1/score, "
                "/v1/rerank, gRPC Score), not generation"
            )
        check_queue(self.engine.queued(), self.edge.limits)
        sampling = resolve_sampling(request.sampling, info.vocab_size)
        sparse = sparse_request.resolve(request, info)
        tools = tool_request.from_request(
            request, limits.max_tools, limits.max_constraint_bytes, limits.max_constraint_depth
        )
        spec = tools.constraint(self.formats.tools, self.formats.tags) if tools else None
        if spec is None and not tools:
            spec = constraint_spec.from_request(
                request.constraint, limits.max_constraint_bytes, limits.max_constraint_depth
            )
        if spec is not None and sampling.ignore_eos:
            raise InvalidArgument(
                "ignore_eos cannot be combined with a constraint: the constraint ends the text"
            )
        adapter = self.adapters.resolve(request.lora_adapter)
        if vision.has_images(request):
            prompt_ids, images = vision.encode_prompt(
                self.images, self.tokenizer, request, info.vocab_size, tools
            )
        else:
            prompt_ids, images = tok.encode(self.tokenizer, request, info.vocab_size, tools), ()
        reasoning = self._opened(request, prompt_ids)
        if spec is not None and reasoning is not None:
            headed = tools is not None and self.formats.tools.channels
            spec = after_reasoning(spec, self.formats.reasoning, reasoning, self.formats.tags, headed)
        max_len = self.engine.max_len
        if len(prompt_ids) >= info.max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the model takes at most {info.max_model_len - 1} "
                "so that one can be generated"
            )
        if sampling.n > self.engine.config.max_seqs:
            raise InvalidArgument(
                f"sampling.n is {sampling.n} but the gateway runs at most {self.engine.config.max_seqs} "
                "sequences at once (--max-seqs): ask for fewer samples"
            )
        if len(prompt_ids) >= max_len:
            raise ResourceExhausted(
                f"prompt has {len(prompt_ids)} tokens; the KV cache holds at most {max_len} tokens"
                " per sequence: give the cache service more memory (--kv-memory/--kv-blocks)"
            )
        seq = Sequence(
            seq_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_len=max_len,
            request_id=request_id,
            cache_salt=salted(tenant, request.cache_salt),
            tenant=tenant.name,
            priority=request.priority,
            constraint=self._matcher(spec, info),
            sparse=sparse,
            keep_special=self.formats.keep(tools is not None, reasoning is not None),
            lora_id=adapter.id if adapter else 0,
            lora_name=adapter.name if adapter else "",
            images=images,
        )
        return seq, tools, reasoning

    def _opened(self, request: generation_pb2.GenerateRequest, prompt_ids: list[int]) -> bool | None:
        """For a chat with a reasoning format: whether the prompt opened the reasoning; else None."""
        fmt = self.formats.reasoning
        if fmt is None or not request.messages:
            return None
        tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return reasoning_formats.opened(fmt, tail)

    def _matcher(self, spec: constraint_spec.Spec | None, info) -> Matcher | None:
        """The constraint's matcher, its first mask filled here (in the request's thread, not the engine)."""
        if spec is None:
            return None
        matcher = self.grammars.matcher(spec, info.vocab_size, list(info.eos_token_ids))
        matcher.mask()
        return matcher


class CallEnd:
    """The end of a call that is not a gRPC one (an HTTP request): `add` registers a callback, `end` runs
    them all once; a callback added after the end runs at once (a client gone while its request was
    being checked still has its sequence aborted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return
        callback()

    def end(self) -> None:
        with self._lock:
            callbacks, self._callbacks, self._ended = self._callbacks, [], True
        for callback in callbacks:
            callback()
