"""Retrieve at memcpy speed: the server's page copies use glibc's non-temporal stores (the tunable is
in the server process's environment)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.cache_server import copy_tuning
from tests.cache_server.helpers import start_server_process


def test_tuned_env_adds_the_threshold_and_keeps_the_users_tunables() -> None:
    assert copy_tuning.tuned_env({})["GLIBC_TUNABLES"] == "glibc.cpu.x86_non_temporal_threshold=0x10000"
    assert copy_tuning.tuned_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=0x10000")
    mine = "glibc.cpu.x86_non_temporal_threshold=0x400000"
    assert copy_tuning.tuned_env({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"] == mine


@pytest.mark.skipif(not copy_tuning.applies(), reason="the tunable exists on glibc x86-64 only")
def test_server_process_runs_with_non_temporal_page_copies() -> None:
    server = start_server_process()
    try:
        environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x10000" in environ
    finally:
        server.stop()

