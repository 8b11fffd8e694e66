"""Paged latent caches (MLA latents, sparse-attention indexer keys) and attention over them.

An MLA layer caches one latent per token, `kv_lora_rank` values then `qk_rope_head_dim` rope
values, for one head; a DSA indexer caches one key of `index_head_dim` values per token. Both are
paged like full attention in the same KV cache group (one block table), each layer in its own
tensor, viewed as

    [num_blocks, block_size, width]         row(block, offset) = block * block_size + offset

The group's `GroupMetadata` (built for full attention) says where new tokens go and which
blocks each attention row reads; the latent layers gather those blocks.

    MLA (not absorbed, as transformers computes it):
        latent [R, L, rank + rope] --kv_b_proj--> k_nope, v [R, L, H, .];  k = k_nope | k_rope (shared)
        softmax(q . k * scale) v                 masked by causality and, for DSA, the selection
    DSA selection (DeepSeek-V3.2 Lightning Indexer):
        score[q, t] = sum_h w[q, h] * relu(scale * iq[q, h] . ik[t])     (w = weights_proj(x) / sqrt(H))
        each query keeps its top `index_topk` visible keys (all of them when fewer are visible)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridkv.engine.attention import AttentionCall, GroupMetadata
from hybridkv.errors import ConfigError
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import IndexerSpec, MLAFormat, MLASpec, dtype_bytes


def latent_view(buffer: torch.Tensor, spec: MLASpec | IndexerSpec, *, group: KVCacheGroupSpec,
                num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A latent layer's byte buffer as [num_blocks, block_size, width] of `dtype` (its spec's).

    Raises ConfigError for the packed sparse-backend formats (fp8_ds_mla, the uint8 DSA indexer):
    the engine computes in the model dtype and needs unquantized latents.
    """
    packed = spec.dtype == "uint8" or (isinstance(spec, MLASpec) and spec.cache_format is not MLAFormat.NATIVE)
    if packed:
        raise ConfigError(f"the engine stores latents in the model dtype, but {spec!r} is a packed format of the "
                          f"GPU kernels; plan with SpecOptions(indexer=IndexerFormat.UNQUANTIZED) and "
                          f"kv_cache_dtype auto")
    width = spec.head_dim if isinstance(spec, MLASpec) else spec.entry_size
    if buffer.numel() != num_blocks * group.block_size * width * dtype_bytes(spec.dtype):
        raise ConfigError(f"a latent tensor of {buffer.numel()} bytes does not hold {num_blocks} blocks of "
                          f"{group.block_size} tokens x {width} {spec.dtype} values")
    return buffer.view(dtype).view(num_blocks, group.block_size, width)


def _rows(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    return blocks * block_size + offsets


def write_latent(cache: torch.Tensor, meta: GroupMetadata, values: torch.Tensor) -> None:
    """Store the step's new latents / keys [T, width] in a latent cache [num_blocks, block_size, width]."""
    flat = cache.view(-1, cache.shape[2])  # [num_blocks * block_size, width]
    flat.index_copy_(0, _rows(meta.write_blocks, meta.write_offsets, cache.shape[1]), values.to(cache.dtype))


def read_latent(cache: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """The latents of a call's key slots: [rows, keys, width] (whole blocks, one gather)."""
    blocks = call.read_block_ids  # [R, B]
    return cache.index_select(0, blocks.flatten()).view(blocks.shape[0], -1, cache.shape[2])


def dsa_select(index_q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, meta: GroupMetadata, *,
               topk: int, scale: float) -> list[torch.Tensor]:
    """Per attention call of `meta`, the keys each query keeps: bool [rows, 1, queries, keys].

    index_q [T, H, D] and weights [T, H] (already divided by sqrt(H)) of the step's queries;
    `index_cache` holds every key's indexer key. Ties are broken by torch.topk, as transformers does.
    """
    selected = []
    for call in meta.calls:
        n = call.rows * call.queries
        q = index_q[call.token_start : call.token_start + n].float()  # [R*Q, H, D]
        q = q.view(call.rows, call.queries, q.shape[1], q.shape[2])  # [R, Q, H, D]
        keys = read_latent(index_cache, call).float()  # [R, L, D]
        scores = F.relu(torch.einsum("rqhd,rld->rqhl", q, keys) * scale)  # [R, Q, H, L]
        w = weights[call.token_start : call.token_start + n].float().view(call.rows, call.queries, 1, -1)
        index = torch.matmul(w, scores).squeeze(2)  # [R, Q, L]
        visible = call.mask[:, 0]  # [R, Q, L]
        index = index.masked_fill(~visible, float("-inf"))
        k = min(topk, index.shape[-1])
        chosen = torch.zeros_like(visible).scatter_(-1, index.topk(k, dim=-1).indices, True)
        selected.append((chosen & visible)[:, None])  # [R, 1, Q, L]
    return selected


def mla_attention(q: torch.Tensor, latent_cache: torch.Tensor, meta: GroupMetadata, kv_b_proj: torch.nn.Module, *,
                  kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int, scale: float,
                  selected: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the step's queries q [T, H, nope + rope] over a layer's paged latents.

    `selected` (DSA): per call, the keys each query keeps, ANDed with causality. Returns [T, H, v_head_dim].
    """
    heads = q.shape[1]
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for i, call in enumerate(meta.calls):
        rows, queries = call.rows, call.queries
        latent = read_latent(latent_cache, call)  # [R, L, rank + rope]
        kv_nope, k_rope = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
        kv = kv_b_proj(kv_nope).view(rows, -1, heads, qk_nope_head_dim + v_head_dim)  # [R, L, H, nope + v]
        k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)  # [R, L, H, nope + rope]
        n = rows * queries
        qr = q[call.token_start : call.token_start + n].view(rows, queries, heads, -1).transpose(1, 2)  # [R, H, Q, .]
        mask = call.mask if selected is None else call.mask & selected[i]  # [R, 1, Q, L]
        o = F.scaled_dot_product_attention(qr, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=scale)  # [R, H, Q, v]
        out[call.token_start : call.token_start + n] = o.transpose(1, 2).reshape(n, heads, v_head_dim)
    return out
