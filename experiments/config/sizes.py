"""Token counts and byte units as the command line, the sweeps and the tables write them."""

from __future__ import annotations

import re

KiB, MiB, GiB = 2**10, 2**20, 2**30


def parse_size(text: str | int) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '131072' -> 131072 (binary K/M/G suffixes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", str(text).strip())
    if not m:
        raise ValueError(f"size must look like 131072, 128K or 1M, got {text!r}")
    return int(m[1]) * {"": 1, "k": KiB, "m": MiB, "g": GiB}[m[2].lower()]


def format_size(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 1000 -> '1000'."""
    for unit, mult in (("M", MiB), ("K", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
