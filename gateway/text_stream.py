"""One sample's text as it is generated: incremental detokenization, then stop strings."""

from gateway.tokenizer import Detokenizer


class TextStream:
    """Releases text whose fate is decided: held back while it may be the start of a stop string.

    Once a stop string matches, the text before it is released and nothing after; `stopped` is set.
    NOTE: matching is on released-plus-held text only, and released text never holds the start of a
    stop string that could still complete, so a stop string split across tokens is caught.
    """

    __slots__ = ("_detokenizer", "_stop", "_held", "stopped")

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._held = ""
        self.stopped = False

    def append(self, token_ids: list[int], match: bool = True) -> str:
        """The text released by these tokens; `match` False (before min_tokens) only holds text back."""
        assert not self.stopped, "a stopped stream takes no more tokens"
        self._held += self._detokenizer.step(token_ids)
        return self._release(match, final=False)

    def finish(self, match: bool = True) -> str:
        """All text still held at the end of the generation (up to a stop string found in it)."""
        if self.stopped:
            return ""
        self._held += self._detokenizer.flush()
        return self._release(match, final=True)

    def _release(self, match: bool, final: bool) -> str:
        held = self._held
        if match and (found := self._first_match(held)) is not None:
            self.stopped, self._held = True, ""
            return held[:found]
        keep = 0 if final else self._partial_suffix(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep]

    def _first_match(self, text: str) -> int | None:
        starts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(starts) if starts else None

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper start of some stop string."""
        return max(
            (n for s in self._stop for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
            default=0,
        )
