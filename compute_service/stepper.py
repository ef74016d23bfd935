"""The attached pool and the one-step path that Forward and ForwardSteps share: a request checked against the
pool it names, then run as one step (compute_service/server.py, compute_service/forward_steps.py)."""

import threading
import time
from pathlib import Path

import torch
from prometheus_client import Counter, Histogram

from common.errors import FailedPrecondition
from common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS
from common.session_fence import SessionFence
from compute_service.batch import ForwardBatch
from compute_service.fencing import StepFence
from compute_service.model_loader import ModelSpec
from compute_service.pool_layout import PoolLayout
from compute_service.prompt_logprobs import reply_fields
from compute_service.runner import Runner, StepTimes
from compute_service.threads import ThreadPolicy
from compute_service.validation import Limits
from protos import common_pb2, compute_pb2

FORWARD_SECONDS = Histogram(
    "pagedserve_forward_step_duration_seconds", "Duration of one Forward step.", buckets=LATENCY_BUCKETS
)
SPARSE_ROWS = Counter(
    "pagedserve_forward_sparse_rows",
    "Decodes that attended block-sparse (--sparse-attention), one per row and step.",
)
IMAGES_ENCODED = Counter("pagedserve_vision_images_encoded", "Images the vision encoder encoded.")
IMAGE_CACHE_HITS = Counter(
    "pagedserve_vision_image_cache_hits",
    "Images of steps found encoded already (image store or --encoder-cache-images).",
)
ENCODER_SECONDS = Counter("pagedserve_vision_encoder_seconds", "Time the vision encoder ran.")
IMAGE_STORE_READS = Counter(
    "pagedserve_vision_image_store_reads", "Images of steps read in place from the pool's image store."
)
STEP_TOKENS = Histogram("pagedserve_forward_step_tokens", "Tokens in one step.", buckets=TOKEN_BUCKETS)
NO_POOL = "no KV pool attached: the gateway must call AttachPool first"
SEGMENT_REMOVED = "the pool's segment was removed (cache restarted?): attach the new pool"


class Stepper:
    """One attached pool (its epoch, limits and session fence) and the model's runner. Steps run one at a
    time: a caller holds `lock` from its request's check to its last step."""

    def __init__(self, runner: Runner, spec: ModelSpec, log, threads: ThreadPolicy | None = None) -> None:
        self.runner, self.spec, self.log, self.threads = runner, spec, log, threads
        self.lock = threading.Lock()
        self.epoch: str | None = None
        self.limits: Limits | None = None
        self.fence = StepFence(None)
        self._segment: Path | None = None
        self._no_pool = NO_POOL

    def attach(
        self,
        handle: common_pb2.PoolHandle,
        pool: torch.Tensor,
        layout: PoolLayout,
        fence: SessionFence | None,
    ) -> None:
        """Steps run on `pool` (the handle's, already checked against the model) from now on."""
        num_blocks, block_size = pool.shape[2], pool.shape[3]
        with self.lock:
            if self.runner.group is not None:
                self.runner.group.attach(handle)
            self.runner.attach(pool, layout)
            self.fence.close()
            self.fence = StepFence(fence)
            self.epoch = handle.epoch
            self.limits = Limits(
                self.spec.vocab_size,
                self.spec.max_model_len,
                num_blocks,
                block_size,
                self.spec.plan.sparse_attention,
                layout.num_groups,
                self.spec.pooling.mode if self.spec.pooling else "",
                self.spec.vision.image_token_id if self.spec.vision else None,
            )
            # NOTE: an accelerator pool has no file to watch; its cache's restart shows as a new epoch.
            self._segment = Path(handle.shm.path) if handle.HasField("shm") else None

    def forward(self, request: compute_pb2.ForwardRequest) -> compute_pb2.ForwardResponse:
        """One Forward: checked, then run while its session is open at the cache."""
        with self.lock:
            start = time.perf_counter()
            batch = self.checked(request)
            with self.fence.holding(request.session_epoch):
                return self.run(batch, start)[0]

    def checked(self, request: compute_pb2.ForwardRequest) -> ForwardBatch:
        """The request's batch, on the attached pool; raises FailedPrecondition or InvalidArgument. The caller
        holds the lock."""
        self._drop_removed_pool()
        if self.epoch is None:
            raise FailedPrecondition(self._no_pool)
        if request.pool_epoch != self.epoch:
            raise FailedPrecondition(
                f"stale pool epoch {request.pool_epoch!r}, attached pool is {self.epoch!r}: the cache "
                "service restarted; create a pool and AttachPool its handle again"
            )
        return ForwardBatch.from_request(request, self.limits)

    def run(self, batch: ForwardBatch, start: float) -> tuple[compute_pb2.ForwardResponse, torch.Tensor]:
        """One checked step, begun (received) at `start`, and the tokens it sampled; the caller holds the
        lock."""
        if self.threads is not None:
            self.threads.apply(len(batch.token_ids))
        times = StepTimes(prepare=time.perf_counter() - start)
        sampled = self.runner.forward(batch, times)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        FORWARD_SECONDS.observe(elapsed_ms / 1e3)
        STEP_TOKENS.observe(len(batch.token_ids))
        SPARSE_ROWS.inc(times.sparse_rows)
        IMAGES_ENCODED.inc(times.images_encoded)
        IMAGE_CACHE_HITS.inc(times.image_cache_hits)
        IMAGE_STORE_READS.inc(times.image_store_reads)
        ENCODER_SECONDS.inc(times.encoder)
        self.log.debug(
            "forward", tokens=len(batch.token_ids), seqs=len(batch.context_lens), ms=round(elapsed_ms, 2)
        )
        reply = compute_pb2.ForwardResponse(
            token_ids=sampled.tokens.tolist(),
            logprobs=sampled.logprobs.tolist(),
            forward_ms=elapsed_ms,
            top_logprobs_width=sampled.top_ids.shape[1],
            top_token_ids=sampled.top_ids.flatten().tolist(),
            top_logprobs=sampled.top_logprobs.flatten().tolist(),
            prepare_ms=times.prepare * 1e3,
            model_ms=times.model * 1e3,
            attention_ms=times.attention * 1e3,
            sample_ms=times.sample * 1e3,
            sparse_rows=times.sparse_rows,
            images_encoded=times.images_encoded,
            image_cache_hits=times.image_cache_hits,
            image_store_reads=times.image_store_reads,
            encoder_ms=times.encoder * 1e3,
            **reply_fields(sampled.prompt),
        )
        if sampled.pooled is not None:
            reply.pooled = sampled.pooled.numpy().astype("<f4").tobytes()
        return reply, sampled.tokens

    def drop_removed_pool(self) -> bool:
        """Unmaps the attached pool once its segment is gone (its cache exited); True if it did."""
        with self.lock:
            return self._drop_removed_pool()

    def _drop_removed_pool(self) -> bool:
        if self._segment is None or self._segment.exists():
            return False
        self.log.warning("pool_segment_removed", path=str(self._segment), epoch=self.epoch)
        self.runner.detach()
        self.fence.close()
        self.fence = StepFence(None)
        self.epoch, self.limits, self._segment, self._no_pool = None, None, None, SEGMENT_REMOVED
        return True
