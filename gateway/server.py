"""The public Generation service: validates requests, feeds the engine, streams its outputs."""

import argparse
import threading
import uuid

import structlog

from common import logging as pslogging
from common import metrics as psmetrics
from common import transport
from common.errors import InvalidArgument, ResourceExhausted, Unavailable
from common.model_files import local_copy
from common.server import Server, serve
from gateway import metrics
from gateway import tokenizer as tok
from gateway.admission import Admission
from gateway.auth import Tenant, salted
from gateway.config import EngineConfig
from gateway.edge import Edge, EdgeConfigError
from gateway.engine import Engine
from gateway.health import DownstreamWatcher
from gateway.limits import check_queue, check_request, check_request_id
from gateway.options import OPTIONS
from gateway.outputs import Output
from gateway.recovery import PeerFault
from gateway.sampling import resolve_sampling
from gateway.sequence import Sequence
from gateway.streams import StreamSlots
from protos import generation_pb2, generation_pb2_grpc

log = structlog.get_logger()
SERVICE = "pagedserve.v1.Generation"
FINISH_REASONS = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self, engine: Engine, tokenizer, admission: Admission, slots: StreamSlots, edge: Edge
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._admission = admission
        self._slots = slots
        self._edge = edge

    def _attached_model(self):
        if self._engine.model_info is None:
            raise Unavailable(
                "the gateway is still attaching to the cache and compute services; retry shortly"
            )
        return self._engine.model_info

    def _new_sequence(
        self, request: generation_pb2.GenerateRequest, request_id: str, tenant: Tenant, info
    ) -> Sequence:
        """The request's sequence; refused before tokenizing if the queue is full or a control is bad."""
        check_queue(self._engine.queued(), self._edge.limits)
        sampling = resolve_sampling(request.sampling, info.vocab_size)
        prompt_ids = tok.encode(self._tokenizer, request, info.vocab_size)
        max_len = self._engine.max_len
        if len(prompt_ids) >= info.max_model_len:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the model takes at most {info.max_model_len - 1} "
                "so that one can be generated"
            )
        if sampling.n > self._engine.config.max_seqs:
            raise InvalidArgument(
                f"sampling.n is {sampling.n} but the gateway runs at most {self._engine.config.max_seqs} "
                "sequences at once (--max-seqs): ask for fewer samples"
            )
        if len(prompt_ids) >= max_len:
            raise ResourceExhausted(
                f"prompt has {len(prompt_ids)} tokens; the KV cache holds at most {max_len} tokens"
                " per sequence: give the cache service more memory (--kv-memory/--kv-blocks)"
            )
        return Sequence(
            seq_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_len=max_len,
            request_id=request_id,
            cache_salt=salted(tenant, request.cache_salt),
            priority=request.priority,
        )

    def Generate(self, request, context):
        """Streams one response per token (of each of the n samples); ends at finish, cancel or deadline.

        The request id (the request's, else x-request-id metadata, else a new one) is in every
        response and in the gateway, cache and compute logs of the steps that serve it. Refused at once:
        UNAUTHENTICATED without a configured API key, RESOURCE_EXHAUSTED beyond --max-streams concurrent
        streams (--max-streams-per-key of one key) or a full queue, INVALID_ARGUMENT beyond a limit.
        """
        tenant = self._edge.authenticate(context)
        with self._slots.hold(), self._edge.stream_slot(tenant):
            yield from self._generate(request, context, tenant)

    def _generate(self, request, context, tenant: Tenant):
        info = self._attached_model()
        check_request(request, self._edge.limits, info.max_model_len)
        request_id = request.request_id or structlog.contextvars.get_contextvars().get("request_id")
        check_request_id(request_id or "", self._edge.limits)
        request_id = request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        seq = self._new_sequence(request, request_id, tenant, info)
        self._admission.enter(seq)
        context.add_callback(lambda: self._admission.leave(seq.seq_id))
        completion_tokens = [0] * seq.sampling.n
        timer = metrics.RequestTimer()
        log.info("request", prompt_tokens=len(seq.prompt_ids), n=seq.sampling.n, seq_id=seq.seq_id)
        self._engine.submit(seq)
        context.add_callback(lambda: self._engine.abort(seq.seq_id))
        running, first_token_at = seq.sampling.n, None
        while running:
            item = seq.outbox.get()
            if isinstance(item, Exception):
                raise item
            now = timer.token()
            first_token_at = first_token_at or now
            completion_tokens[item.index] += len(item.token_ids)
            reply = self._response(item, request_id)
            if item.finish_reason:
                reply.usage.CopyFrom(
                    generation_pb2.Usage(
                        prompt_tokens=len(seq.prompt_ids),
                        cached_tokens=seq.cached_tokens,
                        completion_tokens=completion_tokens[item.index],
                    )
                )
                reply.timings.CopyFrom(_timings(seq, first_token_at, now))
            yield reply
            running -= bool(item.finish_reason)
        timer.finish(item.finish_reason, len(seq.prompt_ids), seq.scheduled_at - seq.arrival)
        log.info("finished", finish_reason=item.finish_reason, completion_tokens=sum(completion_tokens))

    def _response(self, item: Output, request_id: str) -> generation_pb2.GenerateResponse:
        reply = generation_pb2.GenerateResponse(
            request_id=request_id,
            token_ids=item.token_ids,
            text=item.text,
            index=item.index,
            logprobs=item.logprobs,
        )
        if item.finish_reason:
            reply.finish_reason = FINISH_REASONS[item.finish_reason]
        return reply

    def GetInfo(self, request, context):
        self._edge.authenticate(context)
        info = self._attached_model()
        return generation_pb2.GetInfoResponse(
            model=info.model,
            dtype=info.dtype,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=self._engine.config.block_size,
            num_blocks=self._engine.kv.num_blocks,
            eos_token_ids=info.eos_token_ids,
            kv_dtype=self._engine.handle.dtype,
            device=self._engine.handle.device,
            attention_backend=info.attention_backend,
        )


def _timings(seq: Sequence, first_token_at: float, now: float) -> generation_pb2.Timings:
    return generation_pb2.Timings(
        queue_s=seq.scheduled_at - seq.arrival,
        time_to_first_token_s=first_token_at - seq.arrival,
        total_s=now - seq.arrival,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return OPTIONS.parser("pagedserve gateway: the public API").parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logger = pslogging.configure("gateway", args.log_format, args.log_level)
    edge = _edge(args, logger)
    tokenizer = tok.load(str(local_copy(args.model).path))
    internal = transport.credentials_of(args, "gateway")
    engine = Engine(
        EngineConfig(
            cache_target=args.cache_target,
            compute_target=args.compute_target,
            block_size=args.block_size,
            max_batched_tokens=args.max_batched_tokens,
            max_seqs=args.max_seqs,
            session_ttl_s=args.session_ttl,
            peer_restart_grace_s=args.peer_restart_grace,
            step_timeout_s=args.step_timeout,
            internal_credentials=internal,
        ),
        tokenizer,
    )
    admission = Admission()
    slots = StreamSlots(args.max_streams)
    servicer = GenerationServicer(engine, tokenizer, admission, slots, edge)
    metrics.register(lambda: engine.scheduler)
    psmetrics.serve_metrics(args.host, args.metrics_port, logger)
    server = serve(
        [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE)],
        args.host,
        args.port,
        logger,
        serving=False,
        max_workers=slots.server_threads,
        credentials=edge.credentials,
        max_receive_bytes=edge.limits.max_request_bytes,
    )
    try:
        engine.handshake()
    except PeerFault as fault:
        logger.error("handshake_failed", peer=fault.service, code=fault.err.code().name, error=str(fault))
        server.stop(0)
        raise SystemExit(1) from fault
    loop = threading.Thread(target=engine.run, name="engine", daemon=True)
    loop.start()
    targets = {"cache": args.cache_target, "compute": args.compute_target}
    watcher = DownstreamWatcher(
        server, SERVICE, targets, engine.attached_epoch, engine.peer_restarted, credentials=internal
    )
    watcher.start()
    server.wait(
        on_stop=lambda: (watcher.stop(), engine.stop()),
        drain=lambda: _drain(server, watcher, admission, args.drain_timeout, logger),
    )


def _edge(args: argparse.Namespace, log) -> Edge:
    """The edge from the flags; exits (status 1, the reason on stderr) when it cannot be served."""
    try:
        edge, warnings = Edge.from_args(args)
    except EdgeConfigError as err:
        log.error("bad_edge_config", error=str(err))
        raise SystemExit(f"pagedserve gateway: {err}") from None
    for warning in warnings:
        log.warning("api_keys_readable", warning=warning)
    keys = edge.keys.names if edge.keys else None
    log.info("edge", tls=edge.credentials is not None, api_keys=keys, limits=vars(edge.limits))
    return edge


def _drain(server: Server, watcher: DownstreamWatcher, admission: Admission, timeout: float, log) -> None:
    """On SIGTERM: NOT_SERVING for good at once, new requests refused, running ones finish (timeout)."""
    watcher.stop()
    server.health.enter_graceful_shutdown()
    log.info("draining", running=admission.running(), timeout_s=timeout)
    log.info("drained", cut=admission.drain(timeout))
