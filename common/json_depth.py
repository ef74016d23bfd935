"""How deep arrays and objects nest in JSON text, measured without parsing it (so without recursion): what
lets a front refuse a body or schema nested too deep before json.loads, whose decoder recurses once per
level and raises RecursionError near a thousand levels."""

import re
from itertools import accumulate

# A JSON string literal (escapes included); brackets inside one do not nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of arrays and objects in `text` (a scalar: 0). Exact for valid JSON; for text that
    is not JSON, an estimate that json.loads then refuses anyway."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(1 if b in _OPEN else -1 for b in brackets), default=0)
