"""Start and stop a `hybridkv server` child process (the engine's `kv_server="auto"`, tests).

    server = start_server_process("--chunk-size", "256")   # free loopback ports, waits until listening
    server.endpoint, server.http_url                         # tcp://127.0.0.1:P, http://127.0.0.1:Q
    server.stop()                                            # SIGTERM (graceful), SIGKILL after 30 s

`auth_token`: the server's shared secret (given to the child in $HYBRIDKV_AUTH_TOKEN; the
engine's "auto" server gets a random one, so no other local process can use it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.errors import HybridKVError
from hybridkv.local_secret import secret_for_endpoint
from hybridkv.wire import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    from hybridkv.connector.client import KVClient

LISTENING = re.compile(r"listening on tcp://[^:]+:(\d+) \(control\) and http://[^:]+:(\d+)")


class ServerStartError(HybridKVError, RuntimeError):
    """The server process exited or stayed silent before it was listening."""


class ServerEndpoints:
    """A reachable server's control endpoint and HTTP URL, with a client and an HTTP getter."""

    endpoint: str
    http_url: str
    auth_token: str | None = None  # None: the client reads the environment

    def client(self, timeout_s: float = 5.0) -> KVClient:
        from hybridkv.connector.client import KVClient  # the client is not part of the server

        return KVClient(self.endpoint, timeout_s=timeout_s, auth_token=self.auth_token)

    def http(self, path: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> str:
        sent = dict(headers or {})
        token = self.auth_token or secret_for_endpoint(self.endpoint)  # a server of ours: its secret file
        if token and "Authorization" not in sent:
            sent["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.http_url + path, method=method, headers=sent)
        with urllib.request.urlopen(req, timeout=5) as r:
            return str(r.read().decode())


@dataclass
class ServerProcess(ServerEndpoints):
    proc: subprocess.Popen[str]
    endpoint: str
    http_url: str
    line: str
    auth_token: str | None = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM and wait (the server flushes its tiers); SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def start_server_process(*args: str, timeout_s: float = 60.0, auth_token: str | None = None) -> ServerProcess:
    """`python -m hybridkv server --port 0 --http-port 0 ARGS` on loopback; returns once it listens."""
    cmd = [sys.executable, "-m", "hybridkv", "server", "--port", "0", "--http-port", "0", *args]
    env = dict(os.environ)
    if auth_token is not None:
        env[AUTH_TOKEN_ENV] = auth_token
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None  # stdout=PIPE
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise ServerStartError(f"the KV cache server ({' '.join(cmd[2:])}) exited with {proc.wait()} before "
                                   f"listening: {err.strip()}")
        match = LISTENING.search(line)
        if match:
            return ServerProcess(proc=proc, endpoint=f"tcp://127.0.0.1:{match[1]}",
                                 http_url=f"http://127.0.0.1:{match[2]}", line=line.strip(), auth_token=auth_token)
    proc.kill()
    proc.wait()
    raise ServerStartError(f"the KV cache server did not say it was listening within {timeout_s:g} s")
