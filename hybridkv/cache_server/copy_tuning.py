"""The server's page copies at memcpy speed: glibc's non-temporal stores for every page copy.

The server moves pages between its L1 pool and an engine's mapped segments, one page (tens of KiB
to a few MiB) per copy. glibc's memcpy uses non-temporal stores only above
`x86_non_temporal_threshold` (about 3/4 of the L3 cache: 36 MiB on a 48 MiB L3); below it every
destination cache line is first read in (read-for-ownership), which measured 5.7-6 GB/s for 2 MiB
copies against 10.4-11.4 GB/s with the threshold at 64 KiB (`benchmarks/bench_server.py`: retrieve
went from 0.33 to ~0.8 of memcpy). The pages copied are not read again by the server, so keeping
them out of the cache costs nothing.

glibc reads its tunables once, when the process starts: `hybridkv server` re-executes itself with
`GLIBC_TUNABLES` set when it is missing (same pid, same arguments), and a parent that starts the
server (`start_server_process`) passes it in the environment so no re-exec is needed. Elsewhere
(not glibc, not x86-64) nothing changes.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

THRESHOLD_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
COPY_TUNABLE = f"{THRESHOLD_TUNABLE}=0x10000"  # 64 KiB: the smallest page copies measured still gain
TUNABLES_ENV = "GLIBC_TUNABLES"


def applies() -> bool:
    """Whether the tunable means anything here (glibc on x86-64)."""
    return platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc"


def tuned_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the copy tunable added to `GLIBC_TUNABLES` (one the user set is kept and wins)."""
    out = dict(env)
    current = out.get(TUNABLES_ENV, "")
    if THRESHOLD_TUNABLE not in current:
        out[TUNABLES_ENV] = f"{current}:{COPY_TUNABLE}" if current else COPY_TUNABLE
    return out


def reexec_tuned() -> None:
    """Replace this process by itself with the tunable set, unless it is set already (or means
    nothing here). Call before the server opens anything."""
    if not applies() or THRESHOLD_TUNABLE in os.environ.get(TUNABLES_ENV, ""):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, tuned_env(os.environ))
