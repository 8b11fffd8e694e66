"""Will it fit? A memory request (the engine's KV cache and weights, the KV cache server's L1 pool)
checked against what the machine has free.

The engine runs on CPU, so its KV cache tensors and weights come out of host memory, as does the
server's L1 pool. Asking for more than is free used to end in an allocator error (`[Errno 12]`) or
the OOM killer, after the weights had loaded; `check_fits` says so up front, in GiB, with the
figure it compared against. A leaf module (standard library only), so every package may use it.

"Free" is the kernel's `MemAvailable` (memory that can be handed out without swapping: free
pages plus reclaimable caches), read from /proc/meminfo. Where that file does not exist (not
Linux) the check is skipped rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

from hybridkv.errors import CapacityError

GIB = 1 << 30

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


def check_fits(*, kv_cache_gib: float, weights_bytes: int, meminfo: Path = MEMINFO,
               name: str = "kv_cache_memory_gib") -> None:
    """Raise CapacityError when the budget `name` (GiB) plus the weights exceed the free memory."""
    free = available_bytes(meminfo)
    needed = kv_cache_gib * GIB + weights_bytes
    if free is None or needed <= free:
        return
    weights = f" plus {weights_bytes / GIB:.2f} GiB of weights" if weights_bytes else ""
    raise CapacityError(
        f"{name} {kv_cache_gib:g} GiB{weights} does not fit: "
        f"this machine has {free / GIB:.2f} GiB of memory free (MemAvailable in {meminfo}); "
        f"expected a budget below {max(free - weights_bytes, 0) / GIB:.2f} GiB"
    )
