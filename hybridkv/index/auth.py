"""The index's bearer token: `--auth-token-file FILE`, else $HYBRIDKV_INDEX_TOKEN, else none."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from hybridkv.errors import ConfigError

TOKEN_ENV = "HYBRIDKV_INDEX_TOKEN"
MIN_TOKEN_CHARS = 16


def index_token(token_file: Path | None) -> str:
    """The token routers and publishers must present ("" when none is configured)."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the auth token file {str(token_file)!r}: {e.strerror}") from None
        source = repr(str(token_file))
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        source = f"${TOKEN_ENV}"
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the auth token in {source} has {len(token)} characters, expected at least "
                          f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return token


def check_bind(host: str, *, allow_remote: bool, token: str) -> None:
    """ConfigError for a non-loopback `host` without --allow-remote, or --allow-remote without a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError(f"--host must be an IP address or localhost, got {host!r}") from None
    if not loopback and not allow_remote:
        raise ConfigError(f"--host {host} is not a loopback address; pass --allow-remote (with a token) to serve "
                          "other machines")
    if allow_remote and not token:
        raise ConfigError(f"--allow-remote needs a token (--auth-token-file, or ${TOKEN_ENV}): anyone who reaches "
                          "the index could register publishers and read which prefixes each instance holds")
