"""A fake engine (shared-memory KV buffers with random pages) and an in-process server on free
loopback ports, for the server tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from hybridkv.cache_server.auth import Authenticator
from hybridkv.cache_server.http import HTTPServer
from hybridkv.cache_server.pool import PoolListener
from hybridkv.cache_server.registered_layout import buffer_strides, layer_pages
from hybridkv.cache_server.service import ControlServer
from hybridkv.cache_server.store import KVStore, StoreConfig
from hybridkv.cache_server.tiers.base import L2Tier
from hybridkv.connector.client import SharedKVBuffers, make_layout
from hybridkv.connector.server_process import ServerEndpoints, ServerProcess, ServerStartError
from hybridkv.connector.server_process import start_server_process as _start
from hybridkv.wire import GroupKind, GroupLayout, Layout


def make_group(*, kind: str = "full", layers: int = 1, block: int = 4, page: int = 64, window: int = -1,
               layer_pages: list[int] | None = None) -> GroupLayout:
    """A group; `layer_pages` makes it a group of mixed pages (its largest page is `page_bytes`)."""
    if layer_pages is not None:
        layers, page = len(layer_pages), max(layer_pages)
    return GroupLayout(kind=GroupKind(kind), num_layers=layers, block_tokens=block, page_bytes=page,
                       window_tokens=window, layer_page_bytes=layer_pages)


@dataclass
class FakeEngine:
    """KV buffers in shared memory; page (layer, block) of group g = buffers[layer][block * stride:][:page],
    stride = buffer `layer`'s own stride (or the layout's), page = the group's page of that layer."""

    buffers: SharedKVBuffers
    layout: Layout

    def page(self, gid: int, layer: int, block: int) -> npt.NDArray[np.uint8]:
        start = block * buffer_strides(self.layout)[layer]
        return self.buffers.arrays[layer][start:start + layer_pages(self.layout.groups[gid])[layer]]

    def fill_random(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for arr in self.buffers.arrays:
            arr[:] = rng.integers(0, 256, arr.size, dtype=np.uint8)

    def zero(self) -> None:
        for arr in self.buffers.arrays:
            arr[:] = 0

    def close(self) -> None:
        self.buffers.close()


def make_engine(groups: Sequence[GroupLayout], *, num_blocks: int = 128, model: str = "toy", rank: int = 0,
                seed: int | None = 0) -> FakeEngine:
    stride = max(g.page_bytes for g in groups)
    num_buffers = max(g.num_layers for g in groups)
    buffers = SharedKVBuffers.create(num_buffers=num_buffers, size_bytes=num_blocks * stride)
    specs = buffers.buffer_layouts()
    if any(g.layer_page_bytes is not None for g in groups):  # buffer j's blocks: the largest page of layer j apart
        strides = [max(layer_pages(g)[j] for g in groups if j < g.num_layers) for j in range(num_buffers)]
        specs = [msgspec.structs.replace(s, page_stride_bytes=st) for s, st in zip(specs, strides, strict=True)]
    layout = make_layout(model=model, groups=groups, buffers=specs, num_blocks=num_blocks, page_stride_bytes=stride,
                         rank=rank)
    engine = FakeEngine(buffers=buffers, layout=layout)
    if seed is not None:
        engine.fill_random(seed)
    return engine


@contextlib.contextmanager
def fake_engine(groups: Sequence[GroupLayout], **kwargs: object) -> Iterator[FakeEngine]:
    engine = make_engine(groups, **kwargs)  # type: ignore[arg-type]
    try:
        yield engine
    finally:
        engine.close()


@dataclass
class RunningServer(ServerEndpoints):
    store: KVStore
    endpoint: str
    http_url: str
    auth_token: str | None = None

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the server's own registry (0 when absent)."""
        value = self.store.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.contextmanager
def running_server(config: StoreConfig | None = None, tiers: Sequence[L2Tier] = (), *,
                   max_message_bytes: int = 1 << 20, auth_token: str = "",
                   events: PoolListener | None = None) -> Iterator[RunningServer]:
    """The control loop and HTTP thread of a real server, on free 127.0.0.1 ports, stopped after
    (`auth_token`: its shared secret; its `client()` and `http()` send it; `events`: its KV events)."""
    store = KVStore(config or StoreConfig(chunk_tokens=8, l1_bytes=1 << 24), tiers, events=events)
    auth = Authenticator(auth_token)
    control = ControlServer(store, "127.0.0.1", 0, max_message_bytes, auth=auth)
    http = HTTPServer(store, "127.0.0.1", 0, auth=auth)
    http.start()
    thread = threading.Thread(target=control.serve, daemon=True)
    thread.start()
    try:
        yield RunningServer(store=store, endpoint=f"tcp://127.0.0.1:{control.port}",
                            http_url=f"http://127.0.0.1:{http.port}", auth_token=auth_token)
    finally:
        control.stop()
        thread.join(10)
        http.stop()
        store.close()


def start_server_process(*args: str, timeout_s: float = 60.0) -> ServerProcess:
    """`python -m hybridkv server --port 0 --http-port 0 ARGS`; AssertionError when it does not start."""
    try:
        return _start(*args, timeout_s=timeout_s)
    except ServerStartError as e:
        raise AssertionError(str(e)) from None


@contextlib.contextmanager
def server_process(*args: str) -> Iterator[ServerProcess]:
    server = start_server_process(*args)
    try:
        yield server
    finally:
        server.stop()
