"""The server's shared secret: `--auth-token-file FILE` or the `HYBRIDKV_AUTH_TOKEN` environment
variable (the file wins). When set, every control request (and the registration) must carry it in
its `auth` field, and every HTTP POST must send `Authorization: Bearer <secret>`; `/status` shows
the registered engines' models and fingerprints only to a caller that sent it. Without one the
server behaves as before (loopback only unless --allow-remote, which then warns loudly).

Clients (KVClient, the engine's connector, the vLLM connector, `hybridkv run --kv-server`) read
the same variable, or `HYBRIDKV_AUTH_TOKEN_FILE`, so one setting serves both sides.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from hybridkv.errors import ConfigError
from hybridkv.http_serving import bearer_ok
from hybridkv.wire import AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV

MIN_TOKEN_CHARS = 16


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the auth token file {str(path)!r}: {e.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the auth token in {str(path)!r} has {len(token)} characters, expected at least "
                          f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return token


def server_secret(token_file: Path | None) -> str:
    """The server's secret: `--auth-token-file`, else $HYBRIDKV_AUTH_TOKEN(_FILE), else "" (off)."""
    if token_file is not None:
        return read_token_file(token_file)
    token = os.environ.get(AUTH_TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"${AUTH_TOKEN_ENV} has {len(token)} characters, expected at least {MIN_TOKEN_CHARS}")
    path = os.environ.get(AUTH_TOKEN_FILE_ENV, "").strip()
    return token or (read_token_file(Path(path)) if path else "")


class Authenticator:
    """Checks a presented secret against the server's (`secret` empty: authentication is off)."""

    def __init__(self, secret: str = "") -> None:
        self._secret = secret.encode()

    @property
    def required(self) -> bool:
        return bool(self._secret)

    def ok(self, presented: str) -> bool:
        """Whether `presented` authenticates (always, when the server has no secret)."""
        return not self._secret or hmac.compare_digest(presented.encode(), self._secret)

    def ok_bearer(self, header: str | None) -> bool:
        """Whether an HTTP `Authorization` header authenticates."""
        return bearer_ok(self._secret, header)
