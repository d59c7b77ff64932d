"""Sizes as people type and read them: one rule for every option, one formatter for every output.

Every unit is binary, the way memory is sold and reported (a "4 GB" card shows 4096 MiB):
K = KB = KiB = 1024, M = MB = MiB = 1024², G = GB = GiB = 1024³, T = TB = TiB = 1024⁴, any case.
So `4G`, `4GB` and `4GiB` are all 4,294,967,296 bytes. A bare whole number of at least 1024 is a
count of bytes; a smaller or fractional one is refused (it almost always meant a unit).
"""

from __future__ import annotations

import math
import re

from gemmactl.errors import InvalidOptionError

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
MAX_BYTES = 1 << 60  # 1 EiB: anything larger is a typo, not a machine
HINT = "Write it like 4G, 4GB, 4GiB, 4096M or 3.5G (units are powers of 1024)."


def parse_size(text: str, *, option: str = "size") -> int:
    """Bytes in a size string; refuses zero, negatives, nonsense and absurd sizes (naming the option)."""
    raw = str(text)
    if raw.strip().startswith("-"):
        raise InvalidOptionError(f"{option} must be more than zero, got '{raw}'", hint="Give a size such as 4G.")
    match = _SIZE.match(raw)
    if not match:
        raise InvalidOptionError(f"{option} '{raw}' is not a size", hint=HINT)
    number, unit = match.groups()
    value = float(number) * 1024 ** _UNITS[unit.upper()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise InvalidOptionError(f"{option} '{raw}' is too large", hint="Give the memory of a real machine, e.g. 4G.")
    if not unit and not raw.strip().upper().endswith("B") and value > 0 and (value != int(value) or value < 1024):
        # A bare number counts bytes; "0.5" or "4" meant gibibytes far more often than bytes.
        raise InvalidOptionError(
            f"{option} '{raw}' has no unit, and a bare number counts bytes",
            hint=f"Write the unit, e.g. {option} {number}G; a size below 1K needs a B, e.g. 512B.",
        )
    if value < 1:
        raise InvalidOptionError(f"{option} must be more than zero, got '{raw}'", hint="Give a size such as 4G.")
    return int(value)


def format_size(n: int | float | None, *, unit_suffix: bool = True) -> str:
    """A binary size for people: '3.6 GiB' ('-' for unknown); without the suffix, a value parse_size
    reads back ('3.7G', rounded up)."""
    if n is None:
        return "-"
    for unit, power in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        scaled = n / 1024**power
        if scaled >= 1:
            if unit_suffix:
                return f"{scaled:.1f} {unit}iB"
            return f"{math.ceil(scaled * 10) / 10:g}{unit}"
    return f"{int(n)} B" if unit_suffix else str(int(math.ceil(n)))
