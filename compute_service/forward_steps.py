"""Compute's ForwardSteps: several decode steps in one call, each step's reply sent while the next runs, each
reply saying per row whether the call runs it on (ForwardResponse.running)."""

import contextlib
import queue
import threading
import time
from collections.abc import Iterator

from common.errors import InvalidArgument
from compute_service.batch import ForwardBatch
from compute_service.greedy import is_plain_greedy
from compute_service.multi_step import MultiStepPlan
from compute_service.speculation import replies_by_depth, step_batch, verified
from compute_service.step_thread import StepThread
from compute_service.stepper import Stepper
from protos import compute_pb2


class ForwardSteps:
    """ForwardSteps calls, run on `steps` (the thread every step runs on) over `stepper`'s attached pool."""

    def __init__(self, stepper: Stepper, steps: StepThread) -> None:
        self.stepper, self.steps = stepper, steps

    def serve(self, requests: Iterator[compute_pb2.StepsRequest]) -> Iterator[compute_pb2.ForwardResponse]:
        """Runs the steps on the step thread, which holds the lock throughout (no other step runs between
        them), while this thread sends each reply: compute starts a step as soon as the last one sampled."""
        first = next(requests, None)
        if first is None:
            raise InvalidArgument("ForwardSteps needs a first message: the first step and its limits")
        stop, replies = threading.Event(), queue.SimpleQueue()
        # NOTE: the steps first: the watcher's start would hold the GIL while the step thread wakes.
        self.steps.submit(self._run_steps, first, stop, replies)
        threading.Thread(target=_stop_on_next, args=(requests, stop), daemon=True).start()
        try:
            while (reply := replies.get()) is not None:
                if isinstance(reply, Exception):
                    raise reply
                yield reply
        finally:
            stop.set()

    def _run_steps(self, first: compute_pb2.StepsRequest, stop: threading.Event, replies) -> None:
        """Puts each step's reply (or the exception that ended the steps), then None.

        NOTE: only the first step is checked (but for the session fence, read before every step, as a
        Forward's). A following one is derived from the batch before it
        (ForwardBatch.following), in tensors, and needs no checks of its own: MultiStepPlan.check verified up
        front that every row's slots for all its steps lie in its table, the pool and the model's length; its
        sampling rows are the first step's, its new tokens were sampled here, and the pool stays attached
        while this holds the lock. Checking each step, or building its batch again from a request, cost a
        single stream several times what deriving it does (docs/internals/orchestration.md)."""
        stepper = self.stepper
        try:
            with stepper.lock:
                start = time.perf_counter()
                batch = stepper.checked(first.first)
                plan = MultiStepPlan.check(first, stepper.limits)
                with stepper.fence.holding(first.first.session_epoch) as still_open:
                    drafts = plan.lookup is not None and stepper.limits.sparse is None
                    run = self._drafting_steps if drafts and is_plain_greedy(batch.sampling) else self._steps
                    run(batch, plan, start, stop, replies, still_open)
        except Exception as exc:  # noqa: BLE001 - the handler raises it as the call's status
            replies.put(exc)
        finally:
            replies.put(None)

    def _steps(
        self, batch: ForwardBatch, plan: MultiStepPlan, start: float, stop, replies, still_open
    ) -> None:
        """The steps of a ForwardSteps call, each begun once `still_open()` (the session fence) passed."""
        while True:
            still_open()
            reply, tokens = self.stepper.run(batch, start)
            reply.rows.extend(plan.rows)
            keep = plan.advance(tokens.tolist())
            going_on = bool(keep) and not stop.is_set()
            going = set(keep) if going_on else set()
            reply.running.extend(i in going for i in range(len(reply.rows)))
            if going_on:
                # NOTE: derived before this reply is put, so the thread that sends it does not take the GIL
                # from the derivation (its Python runs during the next forward instead)
                start = time.perf_counter()
                batch = batch.following(tokens, keep, self.stepper.limits.block_size)
            replies.put(reply)
            if not going_on:
                return

    def _drafting_steps(
        self, first: ForwardBatch, plan: MultiStepPlan, start: float, stop, replies, still_open
    ) -> None:
        """The steps of a call whose rows draft (compute_service.speculation): each feeds every running row's
        token and the drafts its lookup finds, and sends a reply per token depth of what the rows keep.

        NOTE: not on --sparse-attention (checked by the caller): its block summaries track decode rows."""
        tokens, starts, block_size = (
            first.token_ids.tolist(),
            first.positions.tolist(),
            self.stepper.limits.block_size,
        )
        while True:
            still_open()
            rows = plan.rows
            feeds = [[tokens[row], *plan.lookup.draft(row, plan.room(row))] for row in rows]
            batch = step_batch(first, rows, feeds, [starts[row] for row in rows], block_size)
            reply, chosen = self.stepper.run(batch, start)
            kept, running = [], []
            for row, yielded in zip(rows, verified(feeds, chosen.tolist()), strict=True):
                taken, going = plan.take(row, yielded)
                kept.append(taken)
                tokens[row], starts[row] = taken[-1], starts[row] + len(taken)
                plan.lookup.extend(row, taken)
                if going:
                    running.append(row)
            stopping = stop.is_set()
            plan.rows = running
            start = time.perf_counter()
            for part in replies_by_depth(reply, rows, feeds, kept, set() if stopping else set(running)):
                replies.put(part)
            if not running or stopping:
                return


def _stop_on_next(request_iterator: Iterator[compute_pb2.StepsRequest], stop: threading.Event) -> None:
    """A ForwardSteps caller's second message, half-close or cancellation: stop after the running step."""
    # NOTE: a cancelled call ends the iterator with an error: stop all the same.
    with contextlib.suppress(Exception):
        next(request_iterator, None)
    stop.set()
