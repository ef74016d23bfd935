"""The gateway process: the public Generation service (gRPC) and the OpenAI-compatible HTTP API, both
serving through gateway.generation; the engine loop, the health watcher, the drain."""

import argparse
import sys
import threading

import structlog
from grpc_health.v1 import health_pb2

from common import logging as pslogging
from common import metrics as psmetrics
from common import transport
from common.model_files import local_copy
from common.options import REFUSED
from common.server import Server, channel, serve
from gateway import chat_template, metrics, vision
from gateway import tokenizer as tok
from gateway.admission import Admission
from gateway.chat_formats import ChatFormats
from gateway.config import EngineConfig
from gateway.edge import Edge, EdgeConfigError
from gateway.embedding import Embeddings
from gateway.engine import Engine
from gateway.generation import Generation
from gateway.health import DownstreamWatcher
from gateway.http import dashboard, metrics_route
from gateway.http.anthropic.route import messages_api
from gateway.http.app import create_app
from gateway.http.bridge import Bridge
from gateway.http.dashboard_state import DashboardSource
from gateway.http.image_parts import MediaSources
from gateway.http.lora_api import lora_api
from gateway.http.openai_api import Front, openai_api
from gateway.http.responses.route import responses_api
from gateway.http.serve import HttpServer
from gateway.http.tokenize_api import tokenize_api
from gateway.options import OPTIONS
from gateway.recovery import PeerFault
from gateway.scoring import Scores
from gateway.streams import StreamSlots
from gateway.structured.grammars import Grammars
from gateway.structured.limits import ConstraintLimits
from protos import cache_pb2_grpc, generation_pb2, generation_pb2_grpc

log = structlog.get_logger()
SERVICE = "pagedserve.v1.Generation"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._embeddings = Embeddings(generation)
        self._scores = Scores(self._embeddings)

    def Generate(self, request, context):
        """Streams one response per token (of each of the n samples); ends at finish, cancel or deadline
        (see Generation.stream). UNAUTHENTICATED at once without a configured API key."""
        tenant = self._generation.edge.authenticate(context.invocation_metadata())
        yield from self._generation.stream(request, tenant, context.add_callback)

    def Embed(self, request, context):
        """One embedding per input (see Embeddings.embed). UNAUTHENTICATED at once without a configured API
        key."""
        tenant = self._generation.edge.authenticate(context.invocation_metadata())
        return self._embeddings.embed(request, tenant, context.add_callback)

    def Score(self, request, context):
        """One score per (query, document) pair (see Scores.score)."""
        tenant = self._generation.edge.authenticate(context.invocation_metadata())
        return self._scores.score(request, tenant, context.add_callback)

    def Tokenize(self, request, context):
        """The prompt's or chat's token ids, as Generate encodes them."""
        self._generation.edge.authenticate(context.invocation_metadata())
        return self._generation.tokenize(request)

    def Detokenize(self, request, context):
        self._generation.edge.authenticate(context.invocation_metadata())
        return self._generation.detokenize(request)

    def GetInfo(self, request, context):
        self._generation.edge.authenticate(context.invocation_metadata())
        info = self._generation.attached_model()
        engine = self._generation.engine
        return generation_pb2.GetInfoResponse(
            model=self._generation.model_name(info),
            dtype=info.dtype,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=engine.config.block_size,
            num_blocks=engine.kv.num_blocks,
            eos_token_ids=info.eos_token_ids,
            kv_dtype=engine.handle.dtype,
            device=engine.handle.device,
            attention_backend=info.attention_backend,
            weights=info.weights or info.dtype,
            pooling=info.pooling.type,
            embedding_dimensions=info.pooling.dimensions if info.pooling.type else 0,
            embedding_matryoshka=info.pooling.matryoshka,
            embedding_matryoshka_dimensions=info.pooling.matryoshka_dimensions,
            lora_adapters=self._generation.adapters.listed(),
            tensor_parallel_size=info.tensor_parallel_size or 1,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return OPTIONS.parser("pagedserve gateway: the public API").parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logger = pslogging.configure("gateway", args.log_format, args.log_level)
    edge = _edge(args, logger)
    http = _bind_http(args, logger)
    model_path = str(local_copy(args.model).path)
    tokenizer = tok.load(model_path)
    if args.chat_template is not None:
        tokenizer.chat_template = _chat_template(args.chat_template, logger)
    internal = transport.credentials_of(args, "gateway")
    engine = Engine(
        EngineConfig(
            cache_target=args.cache_target,
            compute_target=args.compute_target,
            block_size=args.block_size,
            max_batched_tokens=args.max_batched_tokens,
            max_seqs=args.max_seqs,
            prefill_tokens_with_decodes=args.prefill_tokens_with_decodes,
            decode_step_target_ms=args.decode_step_target_ms,
            pace_streams=args.pace_streams,
            decode_steps=args.decode_steps,
            draft_tokens=args.draft_tokens,
            session_ttl_s=args.session_ttl,
            peer_restart_grace_s=args.peer_restart_grace,
            step_timeout_s=args.step_timeout,
            internal_credentials=internal,
            step_hook=args.step_hook,
            encoder_budget=args.encoder_budget,
            prefill_target=args.prefill_compute_target,
            prefill_threshold=args.prefill_threshold,
        ),
        tokenizer,
    )
    admission = Admission()
    slots = StreamSlots(args.max_streams)
    grammars = Grammars(tokenizer, ConstraintLimits.from_args(args))
    formats = _formats(args, tokenizer, logger)
    generation = Generation(engine, tokenizer, admission, slots, edge, grammars, formats)
    generation.served_names = tuple(name for name in (args.served_model_name or "").split(",") if name)
    if vision.is_vision_model(model_path):
        generation.images = vision.ImageInputs(model_path, edge.limits)
    servicer = GenerationServicer(generation)
    metrics.register(engine)
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
    info = engine.model_info
    threading.Thread(
        target=grammars.prepare_at_start,
        args=(info.vocab_size, list(info.eos_token_ids)),
        name="grammar",
        daemon=True,
    ).start()
    targets = {"cache": args.cache_target, "compute": args.compute_target}
    if args.prefill_compute_target:
        targets["prefill"] = args.prefill_compute_target
    watcher = DownstreamWatcher(
        server,
        SERVICE,
        targets,
        engine.attached_epoch,
        engine.peer_restarted,
        credentials=internal,
        optional=frozenset({"prefill"}),
    )
    if http is not None:
        _serve_http(http, generation, server, args, internal, logger)
    # NOTE: the watcher reports SERVING: only once the HTTP API is up and a SIGTERM drains.
    server.handle_signals(drain=lambda: _drain(server, watcher, admission, args.drain_timeout, logger))
    watcher.start()
    server.wait(on_stop=lambda: (watcher.stop(), http and http.stop(), engine.stop()))


def _formats(args: argparse.Namespace, tokenizer, log) -> ChatFormats:
    """The chat formats of the flags; exits (status 1, the reason on stderr) when they cannot be served."""
    try:
        formats = ChatFormats.of(tokenizer, args.tool_call_parser, args.reasoning_parser)
    except ValueError as err:
        log.error("bad_chat_formats", error=str(err))
        raise SystemExit(f"pagedserve gateway: {err}") from None
    reasoning = formats.reasoning.name if formats.reasoning else None
    log.info("chat_formats", tool_call_parser=formats.tools.name, reasoning_parser=reasoning)
    return formats


def _chat_template(value: str, log) -> str:
    """--chat-template's template; exits (status 2, the reason on stderr) when it cannot be used."""
    try:
        return chat_template.resolve(value)
    except chat_template.ChatTemplateError as err:
        log.error("bad_chat_template", error=str(err))
        print(f"pagedserve gateway: {err}", file=sys.stderr)
        raise SystemExit(REFUSED) from None


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


def _bind_http(args: argparse.Namespace, log) -> HttpServer | None:
    """The HTTP API's listening socket (None with --http-port 0); exits (status 1) if it cannot bind."""
    if not args.http_port:
        return None
    try:
        return HttpServer(args.host, args.http_port, args.tls_cert, args.tls_key)
    except OSError as err:
        log.error("http_bind_failed", port=args.http_port, error=str(err))
        raise SystemExit(
            f"pagedserve gateway: cannot listen on {args.host}:{args.http_port}: {err}"
        ) from None


def _serve_http(http: HttpServer, generation: Generation, server: Server, args, internal, log) -> None:
    """The HTTP app on its socket: the OpenAI-compatible API (health as gRPC's) and the dashboard."""

    def health() -> int:
        # NOTE: no context needed: Check uses it only for a service never registered, and serve() did.
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        return server.health.Check(request, None).status

    # NOTE: without --served-model-name, requests may name the model as --model gives it too.
    aliases = frozenset(generation.served_names) or frozenset({args.model})
    media = MediaSources.of(
        args.allowed_local_media_path, args.allowed_media_domains, generation.edge.limits.max_image_bytes
    )
    front = Front(Bridge(generation), health, aliases=aliases, media=media)
    cache = cache_pb2_grpc.CacheStub(channel(args.cache_target, internal))
    source = DashboardSource(generation.engine, cache, generation.edge.keys)
    source.start()
    installers = [openai_api(front), responses_api(front), messages_api(front), tokenize_api(front)]
    installers.append(lora_api(front))
    installers.append(dashboard.installer(source))
    if args.http_metrics == "on":
        installers.append(metrics_route.install)
    http.start(create_app(installers, generation.edge.limits))
    scheme = "https" if http.tls else "http"
    log.info(
        "http_listening", url=f"{scheme}://{args.host}:{http.port}/v1", tls=http.tls, dashboard="/dashboard"
    )


def _drain(server: Server, watcher: DownstreamWatcher, admission: Admission, timeout: float, log) -> None:
    """On SIGTERM: NOT_SERVING for good at once, new requests refused, running ones finish (timeout)."""
    watcher.stop()
    server.health.enter_graceful_shutdown()
    log.info("draining", running=admission.running(), timeout_s=timeout)
    log.info("drained", cut=admission.drain(timeout))
