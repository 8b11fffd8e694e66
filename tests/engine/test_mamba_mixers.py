"""The Mamba2 and Mamba1 mixers on explicit state pages against transformers' own mixers.

One call mixes two decodes (continuing states cut from transformers' cache) and a 37-token
prefill chunk that keeps checkpoints after 8 and 24 tokens (as in `all` mode): every output row
equals transformers' no-cache forward of the same tokens, and every written state (conv: the
last K-1 conv inputs; recurrent) equals the state in transformers' cache after that many tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridkv.engine import kernels
from hybridkv.engine.models.jamba import mamba1_dims
from hybridkv.engine.models.mamba1_mixer import Mamba1Mixer
from hybridkv.engine.models.mamba2_mixer import Mamba2Mixer
from hybridkv.engine.models.mamba_hybrid import prefixed_mamba2_dims
from hybridkv.engine.state_layers import StateCache, StateMetadata, StateSequence
from tests.engine.mamba_fixtures import mamba_config, without_dt_clamp

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.bamba.modeling_bamba import BambaMixer  # noqa: E402
from transformers.models.jamba.modeling_jamba import JambaMambaMixer  # noqa: E402

TOLERANCE = 1e-4
CHUNK, CHECKPOINTS = 37, (8, 24)
DECODE_PREFIXES = (5, 19)  # tokens already seen by each decode


class _Context:
    """The two calls a state mixer makes on the forward context."""

    def __init__(self, cache: StateCache, meta: StateMetadata) -> None:
        self.cache, self.meta = cache, meta

    def state_cache(self, slot: int) -> StateCache:
        return self.cache

    def state_metadata(self, slot: int) -> StateMetadata:
        return self.meta


def _pair(kind: str) -> tuple[Any, torch.nn.Module, Any]:
    """(transformers mixer, ours with its weights, config) with random weights of std 0.2."""
    config = mamba_config(kind)
    torch.manual_seed(0)
    reference = (BambaMixer(config, 0) if kind == "bamba" else JambaMambaMixer(config, 0)).float().eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name != "A_log":
                param.normal_(0.0, 0.2)
    without_dt_clamp(reference)
    raw = config.to_dict()
    ours = Mamba2Mixer(prefixed_mamba2_dims(raw)) if kind == "bamba" else Mamba1Mixer(mamba1_dims(raw))
    ours.load_state_dict(reference.state_dict())
    return reference, ours, config


def _states_after(reference: Any, config: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (conv [C, K-1], recurrent) state after running x [1, n, hidden] through its mixer."""
    cache = DynamicCache(config=config)
    reference(x, cache_params=cache)
    conv = cache.get_conv_state(0, state_idx=0)[0]  # [C, K]: the last K inputs, ours keeps K-1
    return conv[:, 1:], cache.get_recurrent_state(0, state_idx=0)[0]


@pytest.mark.parametrize(("kind", "path"), [("bamba", "kernel"), ("bamba", "torch"), ("jamba", "kernel"),
                                            ("jamba", "torch")])
def test_decodes_and_a_checkpointed_chunk_in_one_call_match_transformers(kind: str, path: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "torch":  # the mixer's plain-torch conv, scans and norm (no compiler, HYBRIDKV_KERNELS=0)
        monkeypatch.setattr(kernels, "kernels_available", lambda: False)
    elif not kernels.usable(torch.zeros(1)):
        pytest.skip("the native kernels are off")
    reference, ours, config = _pair(kind)
    generator = torch.Generator().manual_seed(1)
    hidden = config.hidden_size
    streams = [torch.randn(1, n + 1, hidden, generator=generator) for n in DECODE_PREFIXES]
    chunk = torch.randn(1, CHUNK, hidden, generator=generator)
    with torch.no_grad():
        seeded = [_states_after(reference, config, s[:, :-1]) for s in streams]
        conv0, recurrent0 = seeded[0]
        cache = StateCache(conv=torch.zeros(8, *conv0.t().shape), recurrent=torch.zeros(8, *recurrent0.shape))
        for block, (conv, recurrent) in zip((1, 2), seeded, strict=True):
            cache.conv[block], cache.recurrent[block] = conv.t(), recurrent
        meta = StateMetadata(num_decodes=2, decode_blocks=torch.tensor([1, 2]), sequences=(
            StateSequence(token_start=2, num_tokens=CHUNK, block=5, checkpoints=((8, 3), (24, 4))),))
        x = torch.cat([streams[0][0, -1:], streams[1][0, -1:], chunk[0]])  # [2 + CHUNK, hidden]
        out = ours(x, _Context(cache, meta), 0)
        for row, stream in enumerate(streams):
            assert torch.allclose(out[row], reference(stream)[0, -1], atol=TOLERANCE), (kind, "decode", row)
        assert torch.allclose(out[2:], reference(chunk)[0], atol=TOLERANCE), (kind, "prefill")
        written = {1: streams[0], 2: streams[1], 3: chunk[:, :8], 4: chunk[:, :24], 5: chunk}
        for block, tokens in written.items():
            conv, recurrent = _states_after(reference, config, tokens)
            assert torch.allclose(cache.conv[block], conv.t(), atol=TOLERANCE), (kind, "conv", block)
            assert torch.allclose(cache.recurrent[block], recurrent, atol=TOLERANCE), (kind, "recurrent", block)
