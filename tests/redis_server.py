"""A throwaway redis-server (or valkey-server) for tests: 127.0.0.1, a free port, no persistence.

    server = RedisServer.start(tmp_dir)   # waits until it answers PING
    server.url                            # redis://127.0.0.1:PORT/0
    server.stop(); server.restart()       # same port, empty (nothing is saved)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("redis-server", "valkey-server")


def server_binary() -> str | None:
    """The first of redis-server / valkey-server on PATH, or None."""
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, binary: str, port: int, directory: Path) -> None:
        self.binary, self.port, self.directory = binary, port, directory
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, directory: Path, binary: str | None = None) -> RedisServer:
        binary = binary or server_binary()
        if binary is None:
            raise FileNotFoundError(f"none of {', '.join(BINARIES)} is installed")
        server = cls(binary, free_port(), directory)
        server.restart()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start the server (again, on the same port) and wait until it answers."""
        self.stop()
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not answers_ping(self.port):
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"{self.binary} on port {self.port} exited with {self.process.returncode}: {err}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.binary} on port {self.port} did not answer PING in {timeout_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None
