"""Prompt chunks sized by time beside decodes (--decode-step-target-ms): the gateway fits, from its own
steps, how long a step takes for the tokens it computes and the context they attend over, and gives a step
that runs decodes only the prompt tokens that keep its predicted time within the target.

The model: seconds = fixed + per_token × tokens + per_pair × pairs, where `tokens` are the step's computed
tokens (a decode is one, a prompt chunk its length: every token goes through the same linears) and `pairs`
the (query, key) pairs its attention computes (a decode attends over its context; a chunk of n tokens from
position s over n·s + n(n+1)/2). Fixed covers what a step costs whatever it holds: the calls, sampling, the
weights read once per step.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gateway.sequence import Sequence

# Fewest prompt tokens a step with decodes takes however slow its decodes are, so prompts always progress.
MIN_PROMPT_TOKENS = 64
# Each step weighs the earlier ones by this: the fit follows about the last 1 / (1 - DECAY) = 20 steps.
DECAY = 0.95
# Steps seen before the fit sizes chunks; until then a step costs the seconds per token of the steps seen
# (StepCostFit.first_cost), which a new stack's first prompt step already tells.
WARMUP = 8
# NOTE: a step counts at most max(CLIP × the recent mean absolute error, its prediction) above or below its
# prediction: one slow step of a loaded host moves the fit a bounded amount and is forgotten as it decays,
# while a lasting change (a machine twice as slow) is followed within a few steps. A step of a shape the fit
# has not seen the like of (leverage above NOVEL: the first prompt chunk after decodes alone) counts as it
# came, since its prediction is a guess.
CLIP, NOVEL = 4.0, 0.5
# Ridge, relative to the data's scale: keeps the fit solvable while steps do not vary (all decodes alike).
RIDGE = 1e-6
# Features in thousands of tokens and millions of pairs, so that the three are of like size.
TOKEN_UNIT, PAIR_UNIT = 1e3, 1e6


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on: its computed tokens and the attention pairs they make."""

    tokens: int
    pairs: int

    @staticmethod
    def of(seqs: Iterable[Sequence]) -> "StepShape":
        """The shape of the scheduled chunks [num_computed, chunk_end) of `seqs`."""
        tokens = pairs = 0
        for seq in seqs:
            n = seq.chunk_len
            tokens += n
            pairs += chunk_pairs(seq.num_computed, n)
        return StepShape(tokens, pairs)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.tokens / TOKEN_UNIT, self.pairs / PAIR_UNIT])


def chunk_pairs(start: int, n: int) -> int:
    """Attention pairs of n tokens from position `start`: each attends over those before it and itself."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True, slots=True)
class StepCost:
    """A fitted step time: seconds = fixed + per_token × tokens + per_pair × pairs."""

    fixed: float
    per_token: float
    per_pair: float

    def seconds(self, shape: StepShape) -> float:
        return self.fixed + self.per_token * shape.tokens + self.per_pair * shape.pairs


class StepCostFit:
    """Exponentially weighted least squares of step times on their shapes, with each step's error clipped
    (see CLIP) once WARMUP steps are seen. `cost` is the last physical fit: None until there is one (a fit
    in which a token costs nothing is not), then kept while a later fit is not physical."""

    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._error = 0.0
        self._seconds = self._tokens = 0.0
        self.seen = 0
        self.cost: StepCost | None = None

    @property
    def first_cost(self) -> StepCost | None:
        """Until WARMUP steps are seen: each token costs the seconds per token of the steps seen, summed
        (the largest steps weigh most; a step's fixed cost is spread over its tokens, so a chunk beside
        decodes is predicted no faster than a prompt alone ran). None before any step."""
        return StepCost(0.0, self._seconds / self._tokens, 0.0) if self._tokens else None

    def observe(self, shape: StepShape, seconds: float) -> None:
        if self.seen < WARMUP:
            self._seconds, self._tokens = self._seconds + seconds, self._tokens + shape.tokens
        x = shape.features()
        if self.cost is not None:
            predicted = self.cost.seconds(shape)
            error = seconds - predicted
            if self.seen >= WARMUP and self._leverage(x) < NOVEL:
                bound = max(CLIP * self._error, abs(predicted))
                error = min(max(error, -bound), bound)
                seconds = predicted + error
            self._error = DECAY * self._error + (1 - DECAY) * abs(error)
        self._xtx = DECAY * self._xtx + np.outer(x, x)
        self._xty = DECAY * self._xty + x * seconds
        self.seen += 1
        coef = self._solve()
        # NOTE: a fit that turns unphysical keeps the last physical one: the steps of a small model on a
        # loaded host can make a token's cost vanish in the noise, and pacing nothing then would let a
        # full-cap chunk in beside the decodes.
        if coef is not None:
            self.cost = StepCost(coef[0], coef[1] / TOKEN_UNIT, coef[2] / PAIR_UNIT)

    def _leverage(self, x: np.ndarray) -> float:
        """How little the steps seen so far tell of a step of features x: about 1 / (the weighted count of
        steps like it) for a familiar shape, far above 1 for a new one."""
        return float(x @ np.linalg.solve(self._regularized(self._xtx), x))

    def _solve(self) -> np.ndarray | None:
        """Least squares; without the pairs when they would come out negative (attention too cheap to tell
        apart); None when a token would cost nothing."""
        for columns in ([0, 1, 2], [0, 1]):
            coef = np.zeros(3)
            coef[columns] = np.linalg.solve(
                self._regularized(self._xtx[np.ix_(columns, columns)]), self._xty[columns]
            )
            if coef[2] >= 0:
                break
        return coef if coef[1] > 0 else None

    @staticmethod
    def _regularized(a: np.ndarray) -> np.ndarray:
        return a + RIDGE * (np.trace(a) + 1e-12) * np.eye(len(a))


class StepPace:
    """The prompt tokens a step with decodes may take so that its predicted time stays within `target_s`
    (at least MIN_PROMPT_TOKENS); None while nothing tells (no step seen yet, or a fit that is not
    physical: the caller's token cap applies)."""

    def __init__(self, target_s: float) -> None:
        assert target_s > 0, target_s
        self.target_s = target_s
        self.fit = StepCostFit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.fit.observe(shape, seconds)

    def prompt_tokens(self, decodes: StepShape, start: int, stretch: float = 1.0) -> int | None:
        """Prompt tokens, from context position `start`, to add to a step of `decodes` so that it stays
        within `stretch` times the target."""
        cost = self.fit.cost if self.fit.seen >= WARMUP else self.fit.first_cost
        if cost is None:
            return None
        left = stretch * self.target_s - cost.seconds(decodes)
        if left <= 0:
            return MIN_PROMPT_TOKENS
        # per_pair/2 n² + (per_token + per_pair (start + 1/2)) n <= left (chunk_pairs, n tokens)
        a, b = cost.per_pair / 2, cost.per_token + cost.per_pair * (start + 0.5)
        n = left / b if a == 0 else (math.sqrt(b * b + 4 * a * left) - b) / (2 * a)
        return max(MIN_PROMPT_TOKENS, int(n))
