"""TEST HOOK, off unless PAGEDSERVE_TEST_FAIL_STEP is set: each of its comma-separated `[STAGE:]REQUEST_ID`
makes one stage of the steps holding a row of that request raise RuntimeError, where the stage's own code
would fail:

    schedule  Scheduler: while it sizes that row's chunk
    reserve   the step's Reserve, before it is sent (any Reserve holding that row)
    run       the run stage, before the Forward is sent (the default when no stage is named)
    update    while that row's sampled token is appended

The tests (tests/unit/test_step_faults.py, tests/e2e/test_peer_restart.py) check that only that request
fails and its neighbours run on with their tokens (gateway/step_faults.py). Read at each check, so a test
may set it before it starts an engine in its own process."""

import os
from collections.abc import Iterable

from gateway.config import FAIL_STEP_ENV
from gateway.sequence import Sequence

STAGES = ("schedule", "reserve", "run", "update")


def injected(stage: str, seqs: Iterable[Sequence]) -> None:
    """Raises RuntimeError if the hook names this stage and the request of one of `seqs`."""
    value = os.environ.get(FAIL_STEP_ENV)
    if not value:
        return
    for entry in value.split(","):
        named, _, request_id = entry.partition(":")
        if named not in STAGES:
            named, request_id = "run", entry
        if named == stage and any(seq.request_id == request_id for seq in seqs):
            raise RuntimeError(f"injected {stage} fault ({FAIL_STEP_ENV})")
