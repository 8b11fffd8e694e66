"""Multi-page states (`StateLayout.MULTI_PAGE`): a state spread over k pages, gathered for a step.

In the multi-page layout a state group is k page groups of the same layers (`KVCacheGroupSpec.state_page`):
the state of layer j lives in tensor j, page s of it at the block the KV cache manager gave page group s.
The mixers read and write states as contiguous tensors, so for each step the runner gathers every state
a step touches into a scratch buffer of contiguous states ("slots"), runs the model over views of the
scratch, and scatters the states the step wrote back to their pages:

    tensor j:  page group 0 block a | page group 1 block b | ... | page group k-1 block z
                 bytes [0, P)          bytes [P, 2P)               bytes [(k-1)P, M)
    scratch j: slot n = | bytes [0, P) | [P, 2P) | ... | [(k-1)P, kP) |   (a contiguous state)

Each state a step writes gets a slot; the state a request reads (a prefix hit's checkpoint, the
state before a decode) is gathered into the slot of its running state, so the mixers always advance
in place; a request starting from token 0 gets a zeroed slot. After the forward every written slot
is scattered to the blocks its writes name, page by page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridkv.engine.state_layers import StateCache, StateIO, state_view
from hybridkv.plan.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import MambaSpec


class PagedStates:
    """One multi-page state group: its page groups, its layers' scratch views, one step's slots."""

    def __init__(self, kv_config: KVCacheConfig, lead: KVCacheGroupSpec, pages: Sequence[torch.Tensor]) -> None:
        """`lead`: page group 0 of the state; `pages[j]`: tensor j as [num_blocks, page bytes]."""
        self.lead = lead
        self.group_ids = tuple(range(lead.group_id, lead.group_id + lead.state_pages))
        self.page_bytes = kv_config.page_size_bytes
        self.state_bytes = lead.state_pages * self.page_bytes
        self._pages = list(pages[: len(lead.layer_indices)])  # tensor j holds layer j of every group
        self._scratch: list[torch.Tensor] = []
        self._writes: list[tuple[int, list[int]]] = []  # (slot, block of each page group)
        self.caches: dict[int, StateCache] = {}
        self._allocate(1)

    def _allocate(self, slots: int) -> None:
        self._scratch = [torch.zeros(slots, self.state_bytes, dtype=torch.uint8) for _ in self._pages]
        spec = self.lead.spec
        assert isinstance(spec, MambaSpec)
        self.caches = {layer: state_view(scratch.view(-1), spec=spec, num_blocks=slots,
                                         page_bytes=self.state_bytes, layer=layer)
                       for layer, scratch in zip(self.lead.layer_indices, self._scratch, strict=True)}

    @property
    def slot_pages(self) -> list[torch.Tensor]:
        """The scratch of each layer, [slots, state bytes] (what `StateLayers.prepare` zeroes fresh states in)."""
        return self._scratch

    def gather(self, io: Sequence[Mapping[int, StateIO]]) -> list[StateIO]:
        """Copy the states the step reads into slots; return each item's StateIO in slot numbers."""
        self._writes = []
        reads: list[tuple[int, list[int]]] = []
        slot_io: list[StateIO] = []
        for known in io:
            steps = [known[g] for g in self.group_ids]
            lead = steps[0]
            slots = []
            for n in range(len(lead.writes)):
                slots.append(len(self._writes))
                self._writes.append((slots[-1], [step.writes[n][1] for step in steps]))
            running = slots[-1]
            if lead.read is not None:
                reads.append((running, [step.read for step in steps if step.read is not None]))
            slot_io.append(StateIO(read=None if lead.read is None else running,
                                   writes=tuple((t, s) for (t, _), s in zip(lead.writes, slots, strict=True))))
        if len(self._writes) > len(self._scratch[0]):
            self._allocate(max(len(self._writes), 2 * len(self._scratch[0])))
        if reads:
            self._copy_pages(reads, into_slots=True)
        return slot_io

    def scatter(self) -> None:
        """Copy every state the step wrote from its slot to its pages."""
        if self._writes:
            self._copy_pages(self._writes, into_slots=False)
        self._writes = []

    def _copy_pages(self, entries: Sequence[tuple[int, Sequence[int]]], *, into_slots: bool) -> None:
        k, page = self.lead.state_pages, self.page_bytes
        slots = torch.tensor([slot for slot, _ in entries], dtype=torch.int64)  # [n]
        blocks = torch.tensor([list(b) for _, b in entries], dtype=torch.int64).view(-1)  # [n * k]
        for scratch, pages in zip(self._scratch, self._pages, strict=True):
            states = scratch.view(-1, k, page)  # [slots, k, page]
            if into_slots:
                states.index_copy_(0, slots, pages.index_select(0, blocks).view(-1, k, page))
            else:
                pages.index_copy_(0, blocks, states.index_select(0, slots).reshape(-1, page))
