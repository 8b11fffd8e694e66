"""N local `hybridkv serve` engines publishing KV events (ipc:// sockets in a private directory) and
a `hybridkv index` that subscribes to them, each its own process (as deployed: the index's ingest
thread shares no interpreter with the router): the one-command setup of `hybridkv route --engines N`
and of bench_routing.py."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridkv.route.picker import Engine
from hybridkv.route.upstream import UpstreamError, call

__all__ = ["LocalCluster", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class _Proc:
    url: str
    events: str
    replay: str
    proc: subprocess.Popen[bytes]
    log: Path


class LocalCluster:
    """Starts the engines and the index; `close` stops them (engines by SIGTERM, then SIGKILL)."""

    def __init__(self, num_engines: int, *, model: str, engine_args: str = "", served_model_name: str | None = None,
                 ready_timeout_s: float = 300.0) -> None:
        if num_engines < 1:
            raise ValueError(f"--engines must be at least 1, got {num_engines}")
        self.model = served_model_name or model
        self._dir = tempfile.TemporaryDirectory(prefix="hybridkv-route-")
        self.procs: list[_Proc] = []
        index_port = free_port()
        log = Path(self._dir.name) / "index.log"
        with log.open("wb") as out:
            self.index_proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "index", "--port", str(index_port)],
                                               stdout=out, stderr=subprocess.STDOUT)
        self.index_url = f"http://127.0.0.1:{index_port}"
        self._index = _Proc(url=self.index_url, events="", replay="", proc=self.index_proc, log=log)
        try:
            self._wait_ready([self._index], ready_timeout_s)
            for i in range(num_engines):
                self.procs.append(self._start(i, model, engine_args))
            self._wait_ready(self.procs, ready_timeout_s)
            for i, p in enumerate(self.procs):
                status, raw = call(self.index_url, "/register", {
                    "endpoint": p.events, "replay_endpoint": p.replay, "type": "hybridkv", "modelname": self.model,
                    "instance_id": p.url, "block_size": 16, "dp_rank": 0})
                if status != 200:
                    raise RuntimeError(f"the index refused engine {i}: {raw[:200]!r}")
        except BaseException:
            self.close()
            raise

    def _start(self, i: int, model: str, engine_args: str) -> _Proc:
        port = free_port()
        base = Path(self._dir.name)
        events, replay = f"ipc://{base}/e{i}.pub", f"ipc://{base}/e{i}.replay"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "replay_endpoint": replay}
        cmd = [sys.executable, "-m", "hybridkv", "serve", "--model", model, "--port", str(port),
               "--served-model-name", self.model, "--log-level", "warning", "--kv-events-config", json.dumps(config),
               *shlex.split(engine_args)]
        log = base / f"e{i}.log"
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return _Proc(url=f"http://127.0.0.1:{port}", events=events, replay=replay, proc=proc, log=log)

    @staticmethod
    def _wait_ready(procs: list[_Proc], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            while True:
                if p.proc.poll() is not None:
                    tail = p.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                    raise RuntimeError(f"engine {p.url} exited with {p.proc.returncode}: {tail[0]}")
                try:
                    if call(p.url, "/health", timeout_s=2.0)[0] == 200:
                        break
                except UpstreamError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {p.url} not ready within {timeout_s} s")
                time.sleep(0.2)

    def engines(self) -> list[Engine]:
        return [Engine(url=p.url, instance_id=p.url) for p in self.procs]

    def close(self) -> None:
        procs = [*self.procs, self._index]
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        self._dir.cleanup()
