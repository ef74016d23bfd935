"""The engine's settings."""

from dataclasses import dataclass

import grpc

HANDSHAKE_TIMEOUT_S = 900.0
# Each call of a handshake retried after a peer was lost: short, so that a hung peer is retried too.
RETRY_TIMEOUT_S = 5.0
# --decode-step-target-ms: see docs/configuration.md, Scheduling.
DEFAULT_DECODE_STEP_TARGET_MS = 500.0
# --pace-streams: see docs/configuration.md, Few streams, longer steps.
DEFAULT_PACE_STREAMS = 4
# --decode-steps: see docs/configuration.md, Multi-step decode.
DEFAULT_DECODE_STEPS = 32
# --encoder-budget: see docs/vision.md.
DEFAULT_ENCODER_BUDGET = 4096
# --prefill-threshold: see docs/scaling.md, Disaggregated prefill and decode.
DEFAULT_PREFILL_THRESHOLD = 64


@dataclass(frozen=True)
class EngineConfig:
    cache_target: str
    compute_target: str
    block_size: int = 16
    max_batched_tokens: int = 4096
    max_seqs: int = 64
    # Prompt tokens of a step that also runs decodes (0: no cap below max_batched_tokens).
    prefill_tokens_with_decodes: int = 512
    # Milliseconds a step with decodes aims at: its prompt tokens are sized by the fitted step times, within
    # prefill_tokens_with_decodes (0: off, the token cap alone; gateway/step_pace.py).
    decode_step_target_ms: float = DEFAULT_DECODE_STEP_TARGET_MS
    # Decodes beside which the two above hold as given; beside fewer, a step may take this / decodes times
    # as many prompt tokens and as long (gateway/scheduler.py; 1: they hold beside any number).
    pace_streams: int = DEFAULT_PACE_STREAMS
    # Decode steps one Compute call may run (ForwardSteps; 1: one Forward per step).
    decode_steps: int = DEFAULT_DECODE_STEPS
    # Prompt-lookup drafts a plain greedy row may feed per step of a multi-step call (0: off; see
    # compute_service/speculation.py).
    draft_tokens: int = 0
    rpc_timeout_s: float = 120.0
    # Seconds a lost peer has to come back before the waiting requests fail.
    peer_restart_grace_s: float = 30.0
    # A Forward's deadline (0: derived from the recent steps, see StepDeadline).
    step_timeout_s: float = 0.0
    session_ttl_s: float = 10.0
    # mTLS to cache and compute (--internal-certs); None: plaintext (a unix socket or --insecure).
    internal_credentials: grpc.ChannelCredentials | None = None
    # Tests only: faults injected into the steps (--step-hook, gateway/step_runner.py); "": none.
    step_hook: str = ""
    # Image tokens one step may cover (gateway.vision.EncoderBudget).
    encoder_budget: int = DEFAULT_ENCODER_BUDGET
    # A prefill compute beside the compute, attached to the same pool (gateway/disagg.py); "": none.
    prefill_target: str = ""
    # Tokens left to compute from which a prompt chunk runs on the prefill compute (gateway/disagg.py).
    prefill_threshold: int = DEFAULT_PREFILL_THRESHOLD
