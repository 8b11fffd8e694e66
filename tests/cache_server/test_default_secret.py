"""Secure by default (issue 46, item 1): a server started with no secret generates one, writes it to a
0600 file in the user's private runtime directory and removes it at exit; same-user clients find it
there; every state-revealing or state-changing route refuses a caller without it."""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hybridkv import local_secret
from hybridkv.connector.client import KVClient, ServerError, chunk_hashes
from hybridkv.errors import ConfigError
from hybridkv.wire import ErrorCode
from tests.cache_server.helpers import fake_engine, make_group, server_process

CHUNK = 16
GROUPS = [make_group(block=16, page=64)]
TOKENS = list(range(2 * CHUNK + 1))


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("HYBRIDKV_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("HYBRIDKV_AUTH_TOKEN_FILE", raising=False)
    return runtime


def _status(url: str, method: str = "GET", **headers: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_item1_default_server_has_a_private_secret_its_users_clients_find(runtime_dir: Path) -> None:
    with server_process("--chunk-size", str(CHUNK)) as server, fake_engine(GROUPS) as eng:
        port = int(server.endpoint.rsplit(":", 1)[1])
        path = runtime_dir / "hybridkv" / f"server-{port}.secret"
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE((runtime_dir / "hybridkv").stat().st_mode) == 0o700
        secret = path.read_text().strip()
        assert len(secret) == 64
        # anyone else (no secret): refused on every route that reveals or changes state
        assert _status(server.http_url + "/cache/clear", "POST") == 401
        assert _status(server.http_url + "/status") == 401
        assert _status(server.http_url + "/metrics") == 401
        assert _status(server.http_url + "/healthz") == 200
        with KVClient(server.endpoint, auth_token="") as anonymous, pytest.raises(ServerError) as e:
            anonymous.status()
        assert e.value.code is ErrorCode.UNAUTHORIZED
        # the same user's client: nothing to configure
        with KVClient(server.endpoint) as client:
            client.register(eng.layout)
            hashes = chunk_hashes(TOKENS, CHUNK)
            assert client.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[1, 2]]).stored == [True, True]
        assert _status(server.http_url + "/cache/clear", "POST", Authorization=f"bearer {secret}") == 200
        assert json.loads(server.http("/status"))["tiers"][0]["objects"] == 0
    assert not path.exists()  # removed at exit


def test_a_configured_secret_writes_no_file(runtime_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("x" * 32)
    with server_process("--auth-token-file", str(token_file)) as server:
        assert not (runtime_dir / "hybridkv").exists() or not any((runtime_dir / "hybridkv").iterdir())
        with KVClient(server.endpoint, auth_token="x" * 32) as client:
            assert client.status()["registered_engines"] == 0


def test_a_secret_dir_open_to_others_is_refused(runtime_dir: Path) -> None:
    (runtime_dir / "hybridkv").mkdir(mode=0o755)
    os.chmod(runtime_dir / "hybridkv", 0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        local_secret.write_secret(5555, "s" * 64)


def test_a_secret_file_others_could_write_is_not_trusted(runtime_dir: Path) -> None:
    path = local_secret.write_secret(5555, "s" * 64)
    assert local_secret.secret_for_endpoint("tcp://127.0.0.1:5555") == "s" * 64
    assert local_secret.secret_for_endpoint("tcp://10.0.0.1:5555") == ""  # never sent to another machine
    os.chmod(path, 0o644)
    assert local_secret.read_secret(5555) == ""
    path.unlink()
    path.symlink_to(runtime_dir / "elsewhere")
    assert local_secret.read_secret(5555) == ""


def test_without_runtime_dir_a_private_dir_under_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert local_secret.secret_dir().name == f"hybridkv-{os.geteuid()}"
