"""--sparse-attention's value: which blocks a block-sparse decode attends to (compute_service.attention.sparse
chooses them). NOTE: no torch here: `pagedserve up` parses the flag, and its launcher imports no torch."""

from dataclasses import dataclass

FIELDS = ("sink", "recent", "topk")


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
        """The flag's value that gives this config (`pagedserve up` forwards it so)."""
        return f"sink={self.sink},recent={self.recent},topk={self.topk}"

    __str__ = describe


def parse(text: str) -> SparseAttention | None:
    """--sparse-attention's value: 'off' or '' (None), 'on' (the defaults) or 'sink=S,recent=R,topk=K' (any
    of them; the others default); ValueError saying what is accepted."""
    if text in ("", "off"):
        return None
    if text == "on":
        return SparseAttention()
    values: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in FIELDS or not value.isdigit() or name in values:
            raise ValueError(
                f"--sparse-attention {text!r}: expected off, on, or comma-separated sink=S,recent=R,topk=K "
                "with non-negative integers, each named once"
            )
        values[name] = int(value)
    sparse = SparseAttention(**values)
    if sparse.recent < 1 or sparse.topk < 1:
        raise ValueError(
            f"--sparse-attention {text!r}: recent and topk must be at least 1 (the block being written is "
            "always attended to; topk 0 would be a sliding window)"
        )
    return sparse
