"""Publishing a checkpoint: the bound on its shards' size (parsed from "2GB"-like words), and the one
publish sequence every producer (quantize, save, convert) runs.
"""

from __future__ import annotations

from mixprec.errors import MixprecError

DEFAULT_MAX_SHARD_SIZE = "2GB"


def parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper().replace("IB", "B")
    for unit, mult in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30), ("TB", 1 << 40), ("B", 1)):
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise MixprecError(f"bad size {size!r} (use e.g. 500MB, 2GB)") from None
