"""--sparse-attention's value and a request's own settings: which blocks a block-sparse decode attends to
(compute_service.attention.sparse chooses them). NOTE: no torch here: `pagedserve up` parses the flag, and its
launcher imports no torch."""

from dataclasses import dataclass

FIELDS = ("sink", "recent", "topk")
ACCEPTED = (
    "expected off, allow, on, or comma-separated sink=S,recent=R,topk=K (non-negative integers, each named "
    "once), after allow or on or alone"
)


@dataclass(frozen=True)
class SparseAttention:
    """Blocks a decode attends to: `sink` first, `recent` last (>= 1: the one being written), `topk`
    chosen between."""

    sink: int = 1
    recent: int = 4
    topk: int = 8

    @property
    def budget(self) -> int:
        """Blocks a sparse decode attends to; a table of no more attends densely."""
        return self.sink + self.recent + self.topk

    def describe(self) -> str:
        return f"sink={self.sink},recent={self.recent},topk={self.topk}"

    __str__ = describe


@dataclass(frozen=True)
class SparseMode:
    """What --sparse-attention enables: requests may ask for block-sparse decode, those asking without
    settings of their own get `settings`, and those not asking get it too when `default` (else dense)."""

    settings: SparseAttention = SparseAttention()
    default: bool = True

    def describe(self) -> str:
        """The flag's value that gives this mode (`pagedserve up` forwards it so)."""
        return f"{'' if self.default else 'allow,'}{self.settings.describe()}"

    __str__ = describe

    def for_request(self, asked: bool | None) -> SparseAttention | None:
        """A request's settings when it gives none of its own: asked (True), dense (False), the stack's
        default (None)."""
        return self.settings if (self.default if asked is None else asked) else None


def check(sparse: SparseAttention, what: str) -> None:
    """ValueError, naming `what`, unless the settings can run: non-negative, recent and topk at least 1."""
    if min(sparse.sink, sparse.recent, sparse.topk) < 0 or sparse.recent < 1 or sparse.topk < 1:
        raise ValueError(
            f"{what} {sparse.describe()}: sink must be >= 0, recent and topk >= 1 (the block being written "
            "is always attended to; topk 0 would be a sliding window)"
        )


def parse(text: str) -> SparseMode | None:
    """--sparse-attention's value: 'off' or '' (None: requests may not ask); 'allow' (requests may ask, dense
    unless they do); 'on' (sparse unless a request asks for dense); either followed by, or replaced with,
    sink=S,recent=R,topk=K (any of them; the others default; alone: as 'on'). ValueError saying what is
    accepted."""
    if text in ("", "off"):
        return None
    parts = text.split(",")
    default = parts[0] != "allow"
    if parts[0] in ("allow", "on"):
        parts = parts[1:]
    values: dict[str, int] = {}
    for part in parts:
        name, _, value = part.partition("=")
        if name not in FIELDS or not value.isdigit() or name in values:
            raise ValueError(f"--sparse-attention {text!r}: {ACCEPTED}")
        values[name] = int(value)
    settings = SparseAttention(**values)
    check(settings, "--sparse-attention")
    return SparseMode(settings, default)
