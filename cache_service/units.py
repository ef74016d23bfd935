"""Flag and config-file values: sizes in bytes, counts, fractions."""

import argparse
import re
from fractions import Fraction

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1GB', '1.5 GiB' (KB/MB/GB are powers of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: give bytes or e.g. 512MiB, 2GiB, 1GB")
    size = int(Fraction(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def size_or_zero(text: str) -> int:
    """A size as parse_size reads it, or 0."""
    return 0 if text.strip() == "0" else parse_size(text)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value
