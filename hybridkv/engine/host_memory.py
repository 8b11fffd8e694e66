"""Will the KV cache fit? The engine's memory request checked against what the machine has free.

The engine runs on CPU, so its KV cache tensors and weights come out of host memory. Asking for
more than is free used to end in an allocator error (or the OOM killer) after the weights had
loaded; `check_fits` says so up front, in GiB, with the figure it compared against.

"Free" is the kernel's `MemAvailable` (memory that can be handed out without swapping: free
pages plus reclaimable caches), read from /proc/meminfo. Where that file does not exist (not
Linux) the check is skipped rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

from hybridkv.errors import CapacityError
from hybridkv.plan.planner import GIB

MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """`MemAvailable` in bytes, or None when the file or the field is missing."""
    try:
        text = meminfo.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            fields = value.split()  # "21651140 kB"
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def check_fits(*, kv_cache_gib: float, weights_bytes: int, meminfo: Path = MEMINFO) -> None:
    """Raise CapacityError when the KV cache budget plus the weights exceed the free memory."""
    free = available_bytes(meminfo)
    needed = kv_cache_gib * GIB + weights_bytes
    if free is None or needed <= free:
        return
    raise CapacityError(
        f"kv_cache_memory_gib {kv_cache_gib:g} GiB plus {weights_bytes / GIB:.2f} GiB of weights does not fit: "
        f"this machine has {free / GIB:.2f} GiB of memory free (MemAvailable in {meminfo}); "
        f"expected a KV cache budget below {max(free - weights_bytes, 0) / GIB:.2f} GiB"
    )
