"""Every sampling and stopping control, declared once: kind, default, allowed range, off value, where it
applies and a one-line help. The gateway's and compute's validation and defaults, the CLI's flags and the
table in docs/configuration.md derive from `CONTROLS`; a unit test holds the SDK's keyword arguments and the
protos to it.
"""

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from google.protobuf.message import Message


class Kind(enum.Enum):
    FLOAT = "float"
    INT = "int"
    SEED = "uint64"
    FLAG = "bool"
    TOKEN_IDS = "token ids"
    # token id -> bias; the range bounds the biases
    TOKEN_BIAS = "token bias"
    # the range bounds how many (each non-empty)
    STRINGS = "strings"


class Where(enum.Enum):
    # The gateway alone: stopping and samples (compute never sees it).
    GATEWAY = "gateway"
    # Compute, per sampling row of every step (compute_pb2.RowSampling carries it under the same name).
    ROW = "row"


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number, None where unbounded; floats must also be finite. A str bound is another
    control's resolved value, so only the gateway checks that end."""

    low: float | None = None
    high: float | str | None = None
    low_open: bool = False
    high_open: bool = False

    def numeric(self) -> "Range":
        """The range without an end named after another control: what compute can check."""
        return replace(self, high=None) if isinstance(self.high, str) else self

    def holds(self, value: float, bounds: Mapping[str, float]) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        high = bounds[self.high] if isinstance(self.high, str) else self.high
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = high is None or (value < high if self.high_open else value <= high)
        return above and below

    def text(self, bounds: Mapping[str, float] = {}, finite: bool = False) -> str:
        """'(0, 1]', '>= 0', '[0, max_tokens = 16]' (with bounds), '> 0 and finite' (finite floats)."""
        high = f"{self.high} = {bounds[self.high]}" if self.high in bounds else self.high
        if self.low is not None and high is not None:
            return f"{'(' if self.low_open else '['}{self.low}, {high}{')' if self.high_open else ']'}"
        assert self.low is not None and high is None, "only the upper end may be unbounded"
        bound = f"{'>' if self.low_open else '>='} {self.low}"
        return f"{bound} and finite" if finite else bound


@dataclass(frozen=True, slots=True)
class Control:
    name: str
    kind: Kind
    where: Where
    # The value when unset (in the public SamplingParams and in RowSampling).
    default: object
    # One line: the CLI flag's help and the docs table's meaning.
    help: str
    range: Range | None = None
    # The value that turns the control off (None: it has none).
    off: object = None
    # What the range's special values mean, for error messages; default "<off> is off".
    note: str = ""

    def allowed(self, bounds: Mapping[str, float] | None = None) -> str:
        """The range as error messages give it: 'in (0, 1] (1.0 is off)', '>= 0 and finite (0 is greedy)';
        without `bounds` (the other controls' values), its numeric part."""
        bounded = self.range.numeric() if bounds is None else self.range
        text = bounded.text(bounds or {}, finite=self.kind is Kind.FLOAT)
        note = self.note or ("" if self.off is None else f"{self.off} is off")
        return ("in " if text[0] in "([" else "") + text + (f" ({note})" if note else "")

    def range_text(self) -> str:
        """The range as the docs table gives it."""
        if self.kind is Kind.TOKEN_BIAS:
            return f"{{token id: {self.range.text()}}}"
        if self.kind is Kind.STRINGS:
            return f"up to {self.range.high} non-empty strings"
        if self.range is None:
            return "" if self.kind is Kind.FLAG else self.kind.value
        return self.range.text(finite=self.kind is Kind.FLOAT)


MAX_STOP_STRINGS = 16
MAX_SAMPLES = 16
MAX_LOGPROBS = 20
# presence_penalty and frequency_penalty, logit_bias: OpenAI's ranges.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0

_PENALTY = Range(-MAX_PENALTY, MAX_PENALTY)
_ROW, _GATEWAY = Where.ROW, Where.GATEWAY
# In the docs table's order.
CONTROLS = {
    c.name: c
    for c in (
        Control("max_tokens", Kind.INT, _GATEWAY, 16, "generated tokens at most (`finish_reason` `length`)",
                Range(0), note="0: none, the prompt's log-probabilities alone"),
        Control("temperature", Kind.FLOAT, _ROW, 1.0, "0 is greedy", Range(0), note="0 is greedy"),
        Control("top_k", Kind.INT, _ROW, 0, "keep the k most likely tokens", Range(0), off=0),
        Control("top_p", Kind.FLOAT, _ROW, 1.0,
                "keep the smallest set of most likely tokens whose mass reaches p",
                Range(0, 1, low_open=True), off=1.0),
        Control("min_p", Kind.FLOAT, _ROW, 0.0,
                "keep tokens at least `min_p` times as likely as the most likely one", Range(0, 1), off=0.0),
        Control("repetition_penalty", Kind.FLOAT, _ROW, 1.0,
                "HF/vLLM: a logit of a token seen in the prompt or output is divided by it (positive) or "
                "multiplied (negative)",
                Range(0, low_open=True), off=1.0, note="1.0 is off, > 1 discourages repeats"),
        Control("presence_penalty", Kind.FLOAT, _ROW, 0.0,
                "OpenAI: subtracted from the logit of every token generated so far", _PENALTY, off=0.0),
        Control("frequency_penalty", Kind.FLOAT, _ROW, 0.0,
                "OpenAI: subtracted once per time a token was generated", _PENALTY, off=0.0),
        Control("logit_bias", Kind.TOKEN_BIAS, _ROW, MappingProxyType({}),
                "added to the logits; +100 forces a token, -100 bans it",
                Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)),
        Control("seed", Kind.SEED, _ROW, None,
                "same seed, prompt and controls: same output, whatever else is batched"),
        Control("min_tokens", Kind.INT, _ROW, 0,
                "EOS and `stop_token_ids` cannot be sampled, and stop strings do not match, before this many "
                "tokens", Range(0, "max_tokens"), off=0),
        Control("stop_token_ids", Kind.TOKEN_IDS, _GATEWAY, frozenset(),
                "end the generation (the token is returned)"),
        Control("stop", Kind.STRINGS, _GATEWAY, (),
                "end the generation before the first match in the text (`finish_reason` `stop`)",
                Range(0, MAX_STOP_STRINGS)),
        Control("ignore_eos", Kind.FLAG, _GATEWAY, False, "keep generating past the model's EOS tokens"),
        Control("logprobs", Kind.INT, _ROW, None,
                "return each token's log-probability and that many most likely alternatives",
                Range(0, MAX_LOGPROBS), note="top alternatives per token"),
        Control("prompt_logprobs", Kind.INT, _GATEWAY, None,
                "return each prompt token's log-probability and that many most likely alternatives",
                Range(0, MAX_LOGPROBS), note="top alternatives per prompt token"),
        # NOTE: sample i of n draws with (seed + i) mod 2**64: the gateway offsets it when it forks them.
        Control("n", Kind.INT, _GATEWAY, 1, "samples of one prompt (below)", Range(1, MAX_SAMPLES)),
    )
}  # fmt: skip
ROW_CONTROLS = tuple(c for c in CONTROLS.values() if c.where is Where.ROW)


def read(message: Message, control: Control):
    """The control's value in a SamplingParams or RowSampling: its declared default where unset."""
    value = getattr(message, control.name)
    if control.kind is Kind.TOKEN_BIAS:
        return dict(value)
    if control.kind is Kind.TOKEN_IDS:
        return frozenset(value)
    if control.kind is Kind.STRINGS:
        return tuple(value)
    field = message.DESCRIPTOR.fields_by_name[control.name]
    return value if not field.has_presence or message.HasField(control.name) else control.default
