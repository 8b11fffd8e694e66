"""The server's shared secret (issue 25): required on the control channel, the registration socket
and HTTP POSTs when set; `/status` hides the engines from callers without it; a POST with an
Origin header or, on loopback, a foreign Host is refused; clients read it from the environment."""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import pytest

from hybridkv.cache_server.auth import server_secret
from hybridkv.cache_server.config import ServerConfig
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import KVClient, ServerError, chunk_hashes
from hybridkv.errors import ConfigError
from hybridkv.wire import AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV, ErrorCode
from tests.cache_server.helpers import RunningServer, fake_engine, make_group, running_server, server_process

SECRET = "s3cret-" + "x" * 24
CHUNK = 8
GROUPS = [make_group(block=4, page=64)]
TOKENS = list(range(2 * CHUNK + 1))
CONFIG = StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)


def http_code(server: RunningServer, path: str, *, method: str = "GET", **headers: str) -> tuple[int, str]:
    try:
        return 200, server.http(path, method=method, headers=headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_control_and_registration_need_the_secret() -> None:
    with running_server(CONFIG, auth_token=SECRET) as server, fake_engine(GROUPS) as eng:
        for wrong in ("", "s3cret", SECRET + "x"):
            with KVClient(server.endpoint, auth_token=wrong) as c:
                for call in (c.hello, c.status, c.clear):
                    with pytest.raises(ServerError) as e:
                        call()
                    assert e.value.code is ErrorCode.UNAUTHORIZED and "HYBRIDKV_AUTH_TOKEN" in str(e.value)
        with server.client() as c:  # the right secret: everything works
            assert c.hello().auth_required
            c.register(eng.layout)
            assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(TOKENS, CHUNK), block_ids=[[1, 2, 3, 4]]).stored \
                == [True, True]
            assert c.status()["engines"][0]["model"] == "toy"
        assert server.metric("hybridkv_server_errors_total", code="unauthorized") == 9


def test_registration_socket_needs_the_secret_too() -> None:
    """A client that skips `hello` and goes straight to the registration socket without the secret."""
    from tests.cache_server.test_security import register_raw

    with running_server(CONFIG, auth_token=SECRET) as server, fake_engine(GROUPS) as eng:
        reply = register_raw(server, eng.layout, eng.buffers.fds)
        assert getattr(reply, "code", None) is ErrorCode.UNAUTHORIZED
        assert server.metric("hybridkv_server_registered_engines") == 0


def test_http_post_auth_origin_host_and_status_redaction() -> None:
    with running_server(CONFIG, auth_token=SECRET) as server, fake_engine(GROUPS) as eng, \
            server.client() as c:
        c.register(eng.layout)
        c.store(first_chunk=0, chunk_hashes=chunk_hashes(TOKENS, CHUNK), block_ids=[[1, 2, 3, 4]])
        bearer = f"Bearer {SECRET}"
        assert http_code(server, "/cache/clear", method="POST", Authorization="Bearer wrong")[0] == 401
        assert http_code(server, "/cache/clear", method="POST", Authorization="")[0] == 401
        assert http_code(server, "/cache/clear", method="POST", Authorization=bearer,
                         Origin="http://evil.example")[0] == 403
        assert http_code(server, "/cache/clear", method="POST", Authorization=bearer, Host="evil.example:80")[0] == 403
        assert server.metric("hybridkv_server_l1_objects") == 2  # none of those cleared anything
        for path in ("/status", "/metrics"):  # state-revealing: refused without the secret (issue 46)
            code, body = http_code(server, path, Authorization="")
            assert code == 401 and "toy" not in body
        assert http_code(server, "/healthz", Authorization="") == (200, "ok")
        assert http_code(server, "/status", Authorization=f"bEaReR {SECRET}")[0] == 200  # the scheme in any case
        known = json.loads(http_code(server, "/status")[1])  # helpers send the bearer
        assert known["engines"][0]["fingerprint"] == eng.layout.fingerprint
        assert http_code(server, "/cache/clear", method="POST") == (200, '{"objects_removed":2}')


def test_without_a_secret_posts_still_check_origin_and_host() -> None:
    with running_server(CONFIG) as server:
        assert http_code(server, "/cache/clear", method="POST", Origin="http://evil.example")[0] == 403
        assert http_code(server, "/cache/clear", method="POST", Host="rebound.example")[0] == 403
        assert http_code(server, "/cache/clear", method="POST", Host="localhost:1")[0] == 200


def test_secret_from_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(AUTH_TOKEN_FILE_ENV, raising=False)
    assert server_secret(path) == SECRET and server_secret(None) == ""
    monkeypatch.setenv(AUTH_TOKEN_FILE_ENV, str(path))
    assert server_secret(None) == SECRET
    monkeypatch.setenv(AUTH_TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        server_secret(None)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="at least 16"):
        server_secret(tmp_path / "empty")
    with pytest.raises(ConfigError, match="cannot read"):
        server_secret(tmp_path / "missing")


@pytest.mark.slow
def test_server_process_with_a_token_file_and_a_client_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(SECRET)
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    with server_process("--chunk-size", str(CHUNK), "--auth-token-file", str(path)) as server, \
            fake_engine(GROUPS) as eng:
        monkeypatch.setenv(AUTH_TOKEN_FILE_ENV, str(path))
        with KVClient(server.endpoint) as c:  # reads the file named in the environment
            c.register(eng.layout)
        monkeypatch.delenv(AUTH_TOKEN_FILE_ENV)
        with KVClient(server.endpoint) as c, pytest.raises(ServerError, match="unauthorized"):
            c.hello()


def test_remote_binding_without_a_secret_is_refused_unless_asked() -> None:
    with pytest.raises(ConfigError, match="--auth-token-file"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", allow_remote=True).allow_remote  # allowed; run_server warns loudly


def test_cache_clear_refuses_parameters_it_would_ignore() -> None:
    """`?model=foo` used to clear every model's objects; a parameter it does not honour is refused."""
    with running_server(CONFIG) as server, fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        c.store(first_chunk=0, chunk_hashes=chunk_hashes(TOKENS, CHUNK), block_ids=[[1, 2, 3, 4]])
        code, body = http_code(server, "/cache/clear?model=foo", method="POST")
        assert code == 400 and "takes no parameters" in body and "got model" in body
        assert server.metric("hybridkv_server_l1_objects") == 2
