"""Where a KV cache server started without a configured secret keeps the one it generated, so that
clients of the same user on the same machine find it and nobody else can.

    $XDG_RUNTIME_DIR/hybridkv/server-<control port>.secret     (the runtime dir is the user's, 0700)
    /tmp/hybridkv-<uid>/server-<control port>.secret           (no runtime dir: a 0700 dir of our own)

The directory is 0700 and the file 0600 whatever the umask; a directory that exists but is not
ours, not a directory, or open to others is refused (ConfigError), never used. The server writes
the file when it starts listening and removes it when it stops; a client of a loopback endpoint
reads the file of the endpoint's port (`KVClient`, the vLLM connector, `hybridkv run --kv-server`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from hybridkv.errors import ConfigError

RUNTIME_DIR_ENV = "XDG_RUNTIME_DIR"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def secret_dir() -> Path:
    """The private directory of this user's server secrets (not created here)."""
    runtime = os.environ.get(RUNTIME_DIR_ENV, "").strip()
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "hybridkv"
    return Path(tempfile.gettempdir()) / f"hybridkv-{os.geteuid()}"


def secret_path(control_port: int) -> Path:
    return secret_dir() / f"server-{control_port}.secret"


def _check_private_dir(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path} must be a directory of uid {os.geteuid()} with mode 0700 (it holds the KV server's "
                          f"secret); found mode {stat.filemode(st.st_mode)}, uid {st.st_uid}: remove it or set "
                          f"${RUNTIME_DIR_ENV}")


def write_secret(control_port: int, secret: str) -> Path:
    """Write `secret` for the server on `control_port` (0600, replacing an older file); its path."""
    directory = secret_dir()
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {directory} for the KV server's secret: {e.strerror}") from None
    _check_private_dir(directory)
    path = secret_path(control_port)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, secret.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_secret(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def read_secret(control_port: int) -> str:
    """The secret the same user's server on `control_port` wrote, or "" when there is none (or it is
    not a private file of this user: never trusted then)."""
    path = secret_path(control_port)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > 4096:
            return ""
        return os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)


def secret_for_endpoint(endpoint: str) -> str:
    """The local secret of a `tcp://HOST:PORT` endpoint on this machine ("" for a remote one)."""
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if host not in LOOPBACK_NAMES or not port.isdigit():
        return ""
    return read_secret(int(port))
