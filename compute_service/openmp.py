"""How long compute's OpenMP workers spin after a parallel loop before they sleep, set before torch loads the
GNU OpenMP runtime (which reads it once, from the environment, when it loads).

torch's CPU kernels and the native ones run their parallel loops on OpenMP. After a loop the runtime keeps
its workers spinning, by default for 300,000 pause instructions (GOMP_SPINCOUNT; about 4-15 ms, by CPU), so
that the next loop starts at once. The loops of one step follow each other within microseconds and need a
fraction of a millisecond of that; between two steps (the gateway's round trip, its scheduling, its
streaming to clients) the workers spin on for milliseconds on CPUs that the gateway, the cache and the
clients wait for, and when those then run during the next step, they preempt a worker that the whole loop
waits for. Compute bounds the spin to SPIN_COUNT pauses (about 0.15-0.5 ms), unless its environment sets
GOMP_SPINCOUNT or OMP_WAIT_POLICY itself (docs/internals/cpu-fast-path.md, "Workers sleep between steps").
"""

from collections.abc import MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"
POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT = "10000"


def bound_spin(environ: MutableMapping[str, str]) -> None:
    """Sets GOMP_SPINCOUNT to SPIN_COUNT in `environ` unless it sets GOMP_SPINCOUNT or OMP_WAIT_POLICY."""
    if SPIN_ENV not in environ and POLICY_ENV not in environ:
        environ[SPIN_ENV] = SPIN_COUNT
