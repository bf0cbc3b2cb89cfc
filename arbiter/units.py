"""Sizes in bytes, as tiers.yaml writes them. Torch-free: reading a config imports no model library.

``parse_size("6GiB") -> 6442450944`` and ``format_size(n) -> "6GiB"``. Units: ``B``;
``KB MB GB TB`` (1000-based); ``KiB MiB GiB TiB`` (1024-based); none (bytes). Units are matched
case-insensitively, a space may separate number and unit, decimals are allowed ("1.5GiB"); the
result is floored to whole bytes. Anything else raises ``ValueError``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"6GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``"1024"`` or ``1024``."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"not a size: {text!r} (expected a non-negative number with an optional unit: "
            "B, KB, MB, GB, TB (1000-based) or KiB, MiB, GiB, TiB (1024-based), e.g. '6GiB')"
        )
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a size: {text!r}") from None
    return int(number * _UNITS[unit])


def format_size(n: int) -> str:
    """A short 1024-based form of ``n`` bytes that ``parse_size`` reads back: ``"1.5GiB"``."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if n >= scale:
            text = f"{n / scale:.2f}".rstrip("0").rstrip(".")
            return f"{sign}{text}{unit}"
    return f"{sign}{n}B"
