"""The free-memory check `hybridkv run` and `hybridkv server` make before allocating (hand-made /proc/meminfo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.errors import CapacityError
from hybridkv.host_memory import available_bytes, check_fits

GIB = 1024**3
MEMINFO = "MemTotal:       24683584 kB\nMemFree:        12157440 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB free


def test_available_bytes_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    assert available_bytes(meminfo) == 20 * GIB
    assert available_bytes(tmp_path / "absent") is None
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_bytes(meminfo) is None


def test_check_fits_compares_budget_plus_weights(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    check_fits(kv_cache_gib=19, weights_bytes=GIB, meminfo=meminfo)  # exactly 20 GiB: fits
    with pytest.raises(CapacityError, match=r"kv_cache_memory_gib 19.5 GiB plus 1.00 GiB of weights does not fit: "
                                            r"this machine has 20.00 GiB of memory free .* below 19.00 GiB"):
        check_fits(kv_cache_gib=19.5, weights_bytes=GIB, meminfo=meminfo)
    check_fits(kv_cache_gib=1e9, weights_bytes=0, meminfo=tmp_path / "absent")  # no meminfo: no check


def test_check_fits_names_the_budget_and_leaves_out_absent_weights(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    with pytest.raises(CapacityError, match=r"^--l1-size-gib 100000 GiB does not fit: this machine has 20.00 GiB "
                                            r".* below 20.00 GiB$"):
        check_fits(kv_cache_gib=100000, weights_bytes=0, meminfo=meminfo, name="--l1-size-gib")
