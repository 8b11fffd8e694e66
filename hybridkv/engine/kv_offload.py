"""The engine attached to a KV cache server: shared-memory KV tensors, the registration of the
planner's layout, and for `kv_server="auto"` a server child process of its own.

    transfer = KVTransfer.attach("tcp://127.0.0.1:5555" | "auto", config=plan.config, model_id=..., ...)
    ModelRunner(model, plan.config, buffers=transfer.tensors)    # KV cache tensors over the shm segments
    transfer.connector                                           # the ServerConnector both sides call
    transfer.close()                                             # unregister, close the segments, stop "auto"

The segments are sealed memfds handed to the server as descriptors (docs/cache_server_security.md);
the server maps the same memory, so a store or retrieve is one copy between its pool and the
engine's pages, with nothing serialized. The model identity in the layout (and so in every key)
is the model's name, dtype and a digest of config.json and the weight files (their size and
first and last 64 KiB), so different weights never share an object; the layout fingerprint adds
every group's kind, layers, block size, window and page size.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from hybridkv.connector.client import KVClient, SharedKVBuffers
from hybridkv.connector.engine_layout import layout_from_kv_cache_config
from hybridkv.connector.server_process import ServerProcess, start_server_process
from hybridkv.connector.transfer import ServerConnector, StateSaves
from hybridkv.plan.planner import KVCacheConfig
from hybridkv.plan.specs import SpecKind

log = logging.getLogger("hybridkv.engine")

AUTO = "auto"
_EDGE = 64 * 1024


def model_identity(name: str, model_dir: Path, dtype: str) -> str:
    """`name:dtype:digest` of config.json and the weights (size, first and last 64 KiB of each file)."""
    h = xxhash.xxh3_64()
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_EDGE))
            f.seek(max(0, size - _EDGE))
            h.update(f.read(_EDGE))
    return f"{name}:{dtype}:{h.hexdigest()}"


AUTO_CHUNK_TARGET = 16


def auto_chunk_tokens(config: KVCacheConfig, target: int = AUTO_CHUNK_TARGET) -> int:
    """The smallest multiple of every group's block size that is at least `target` tokens.

    A server hit is whole chunks, and requests admitted in the same step cannot hit each other's
    blocks while those wait for their load (caching is delayed until then), so the engine's own
    server uses chunks of its block size (a hit as fine as a local one) rather than the
    standalone server's 256."""
    step = math.lcm(*[g.block_size for g in config.groups])
    return step * max(1, math.ceil(target / step))


@dataclass
class KVTransfer:
    connector: ServerConnector
    buffers: SharedKVBuffers
    tensors: list[torch.Tensor]
    server: ServerProcess | None  # the server this engine started ("auto"), else None

    @classmethod
    def attach(cls, url: str, *, config: KVCacheConfig, model_id: str, state_saves: StateSaves,
               timeout_s: float) -> KVTransfer:
        """Shared-memory tensors, a started server for "auto", the registration (ConfigError when
        the server rejects the layout; an unreachable server is logged and retried later)."""
        server, auth_token = None, None  # None: the client reads $HYBRIDKV_AUTH_TOKEN(_FILE)
        if url == AUTO:  # a secret of its own: no other local process can use this engine's server
            auth_token = secrets.token_hex(32)
            server = start_server_process("--chunk-size", str(auto_chunk_tokens(config)), "--log-level", "warning",
                                          auth_token=auth_token)
            url = server.endpoint
            log.info("started a KV cache server for this engine: %s", server.line)
        sizes = [t.size_bytes for t in config.tensors]
        buffers = SharedKVBuffers.create(num_buffers=len(sizes), size_bytes=max(sizes))
        try:
            tensors = [torch.from_numpy(a[:size]) for a, size in zip(buffers.arrays, sizes, strict=True)]
            layout = layout_from_kv_cache_config(config, buffers=buffers.buffer_layouts(), model=model_id)
            state_groups = {g.group_id: state_saves for g in config.groups if g.kind is SpecKind.MAMBA}
            client = KVClient(url, timeout_s=timeout_s, auth_token=auth_token)
            connector = ServerConnector(client, layout, state_groups=state_groups)
        except BaseException:
            buffers.close()
            if server is not None:
                server.stop()
            raise
        return cls(connector=connector, buffers=buffers, tensors=tensors, server=server)

    def close(self) -> None:
        """Unregister, drop the tensors and close the segments, stop the server started for "auto"."""
        self.connector.close()
        self.tensors.clear()
        self.buffers.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
