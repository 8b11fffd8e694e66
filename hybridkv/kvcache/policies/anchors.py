"""Anchors: the blocks a value-aware eviction keeps because hits will land there.

A state group (Mamba, Gated DeltaNet) in align mode keeps a checkpoint only where a scheduled
step ends, and a sliding-window group serves a hit only where the window before it is cached. A
hit lands where a later request diverges from (or extends) an earlier one, so both should be
kept exactly there. The positions, per request:

    prompt end      the replay boundary `prompt - 1` (a resend of the same prompt)
    sequence end    the tokens computed when the request finishes (the next chat turn / agent step)
    hit point       where its own hit ended (a branch point of the prefix tree)
    junction        where full attention matched further than every group (`shared_prefix_boundary`)
    hints           `KVRequest.cache_checkpoints`: an application's positions, or chat-turn ends
    every K         `checkpoint_interval_tokens` (PLACED)
    popular depths  the `budget` most frequent branch depths seen so far (PLACED): a system prompt's
                    end gets its checkpoint from the first request that carries it

`placement.py` decides where align-mode chunks end (the checkpoints); `Anchors` marks, for a
value-aware eviction policy (`value.py`), the window tails and checkpoints at every
position above as ANCHOR blocks, kept after the full-attention blocks they make usable, and every
block of a hit whose end `HOT_HITS` hits reached as HOT (a recurring prefix, kept longer still).
Not every kind of position is hit in every workload (a chat's next turn extends the sequence end;
behind a shared system prompt nobody does), so `ReuseRates` counts, per kind, the anchors made and
the hits that ended at one, and an anchor gets its kind's share of the ANCHOR bonus.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from enum import Enum

from hybridkv.kvcache.eviction import BlockValue
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.type_managers.base import SingleTypeManager, Table
from hybridkv.plan.specs import SpecKind

#: hits ending at the same prefix that make the blocks of the last one HOT (value.py)
HOT_HITS = 2
#: the rate, relative to the best kind's, from which an anchor kind keeps its whole bonus (`ReuseRates`)
FULL_SHARE_RATE = 0.5
#: hit ends counted at most (the count restarts when full)
HIT_ENDS_KEPT = 1 << 16


class AnchorKind(Enum):
    """Why a position is an anchor (module docstring); `ReuseRates` learns how often each is hit."""

    HIT = "hit"
    JUNCTION = "junction"
    HINT = "hint"
    STOP = "stop"
    PROMPT_END = "prompt_end"
    SEQUENCE_END = "sequence_end"


class ReuseRates:
    """Per anchor kind: the anchors made, and how many a later hit ended at (each anchor once; a
    position anchored again after its hit is a new anchor).

    A kind's rate is (hit + 1) / (made + 2) (a Laplace prior: a kind seen a few times is neither
    trusted nor dismissed). An anchor's share of the ANCHOR bonus is the best rate among its kinds
    over `FULL_SHARE_RATE` times the best rate of any kind, at most 1: a kind hit half as often as
    the best keeps the whole bonus, a kind hardly ever hit loses it. On a chat the sequence ends are
    hit and keep their bonus; behind a shared system prompt no request extends another's answer, so
    the sequence ends lose theirs and the system prompt's end (a hint, hit by most requests) outlives
    them. The record of which kinds were anchored where is bounded (cleared at `HIT_ENDS_KEPT`
    positions)."""

    def __init__(self) -> None:
        self.made: Counter[AnchorKind] = Counter()
        self.hit: Counter[AnchorKind] = Counter()
        self._kinds_at: dict[BlockHash, set[AnchorKind]] = {}

    def made_at(self, key: BlockHash, kinds: set[AnchorKind]) -> None:
        """`kinds` are anchored at the position whose last block hashes to `key` (a kind already
        anchored there is not counted again)."""
        known = self._kinds_at.get(key)
        if known is None:
            if len(self._kinds_at) >= HIT_ENDS_KEPT:
                self._kinds_at.clear()
            known = self._kinds_at[key] = set()
        self.made.update(kinds - known)
        known |= kinds

    def hit_at(self, key: BlockHash) -> None:
        """A hit ended at `key`: its kinds count a hit, the first time only."""
        kinds = self._kinds_at.pop(key, None)
        if kinds:
            self.hit.update(kinds)

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per kind seen: (anchors made, anchors hit)."""
        return {kind.value: (self.made[kind], self.hit[kind]) for kind in AnchorKind if self.made[kind]}

    def rate(self, kind: AnchorKind) -> float:
        return (self.hit[kind] + 1) / (self.made[kind] + 2)

    def share(self, kinds: set[AnchorKind]) -> float:
        """The share of the ANCHOR bonus an anchor of `kinds` gets (class docstring)."""
        own = max(self.rate(k) for k in kinds)
        return min(1.0, own / (FULL_SHARE_RATE * max([own, *(self.rate(k) for k in self.made)])))


class Anchors:
    """Marks the window tails and state checkpoints at a request's hit points as ANCHOR blocks, and
    every block of a hit whose end was hit before as HOT."""

    def __init__(self, managers: Sequence[SingleTypeManager], alignment_tokens: int,
                 mark: Callable[[Sequence[int], BlockValue, float], None], *, prompt_ends: bool = True) -> None:
        self._managers = list(managers)
        #: whether a prompt's end (`prompt - 1`, an exact resend) is an anchor (not with RunningState.ADOPT)
        self._prompt_ends = prompt_ends
        self._marked = [m for m in managers if m.group.kind in (SpecKind.SLIDING_WINDOW, SpecKind.MAMBA)]
        self._alignment = alignment_tokens
        #: the policy's `mark` (block ids, class, and an ANCHOR's share of its bonus, from `rates`)
        self._mark = mark
        self.rates = ReuseRates()
        #: per request, its anchors not marked yet: (position, block-floored, and the kinds anchored there)
        self._pending: dict[RequestId, list[tuple[int, set[AnchorKind]]]] = {}
        #: per hit end (the prefix hash of its last block): hits that ended there (bounded: cleared when full)
        self._hit_ends: Counter[BlockHash] = Counter()
        #: the hashes where finished requests ended (their last full block; bounded like `_hit_ends`)
        self._seq_ends: set[BlockHash] = set()

    def admitted(self, request: KVRequest, hit_tokens: int) -> None:
        """A request's first allocation: its anchors below the prompt's end; its hit counts for the
        kinds anchored where it ends (`rates`); a hit ending where an earlier one ended makes its blocks
        HOT (a recurring prefix: a system prompt, a shared document; a chat turn's hit on its parent
        ends where no earlier hit did)."""
        points: dict[int, set[AnchorKind]] = {}
        for point, kind in self._anchor_points(request, hit_tokens):
            point -= point % self._alignment
            if point > 0:
                points.setdefault(point, set()).add(kind)
        self._pending[request.request_id] = sorted(points.items(), key=lambda item: item[0])
        key = self._key_at(request, hit_tokens) if hit_tokens >= self._alignment else None
        if key is None:
            return
        self.rates.hit_at(key)
        if len(self._hit_ends) >= HIT_ENDS_KEPT:
            self._hit_ends.clear()
        self._hit_ends[key] += 1
        if self._hit_ends[key] >= HOT_HITS:
            self._mark_hot(request.request_id, hit_tokens)

    def _anchor_points(self, request: KVRequest, hit_tokens: int) -> list[tuple[int, AnchorKind]]:
        """The positions a request anchors below its prompt's end (module docstring), each with why."""
        points = [(hit_tokens, AnchorKind.HIT), (request.shared_prefix_boundary, AnchorKind.JUNCTION)]
        points += [(c, AnchorKind.HINT) for c in request.cache_checkpoints]
        points += [(c, AnchorKind.STOP) for c in request.checkpoint_stops if c not in request.cache_checkpoints]
        if self._prompt_ends:
            prompt = request.num_prompt_tokens if request.num_prompt_tokens is not None else request.num_tokens
            points.append((prompt - 1, AnchorKind.PROMPT_END))
        return points

    def allocated(self, request: KVRequest, num_tokens: int) -> None:
        """Mark the anchors whose blocks are now all allocated (`num_tokens` slots)."""
        pending = self._pending.get(request.request_id)
        while pending and pending[0][0] <= num_tokens:
            point, kinds = pending.pop(0)
            self._mark_at(request, point, kinds)

    def finished(self, request: KVRequest) -> None:
        """Before the request's blocks are released: its computed end is where the next turn lands."""
        self._pending.pop(request.request_id, None)
        if request.num_computed_tokens > 0:
            self._mark_at(request, request.num_computed_tokens, {AnchorKind.SEQUENCE_END})
        computed = request.num_computed_tokens
        key = self._key_at(request, computed - computed % self._alignment)
        if key is not None:
            if len(self._seq_ends) >= HIT_ENDS_KEPT:
                self._seq_ends.clear()
            self._seq_ends.add(key)

    @staticmethod
    def _key_at(request: KVRequest, num_tokens: int) -> BlockHash | None:
        """The prefix hash of the request's last full block within `num_tokens` (the smallest block
        size's chain), None before its first block or past its hashed blocks."""
        size = min(request.block_hashes, default=0)
        end = num_tokens // size if size else 0
        hashes = request.block_hashes.get(size, ())
        return hashes[end - 1] if 0 < end <= len(hashes) else None

    def fresh_end(self, key: BlockHash) -> bool:
        """`key` is where a finished request ended and no hit has ended yet: the next turn of a chat or
        an agent, which takes it over (`RunningState.ADOPT`); a recurring point never is."""
        return key in self._seq_ends and not self._hit_ends.get(key)

    def _mark_hot(self, request_id: RequestId, hit_tokens: int) -> None:
        """Every block of the request's hit of `hit_tokens` (held: its admission just took them) HOT."""
        for manager, table in self._tables(self._managers, request_id):
            last = min(hit_tokens // manager.block_size, table.length)
            if manager.anchor_checkpoint(request_id, last - 1, BlockValue.HOT, 1.0):
                continue
            if manager.group.kind in (SpecKind.FULL, SpecKind.SLIDING_WINDOW, SpecKind.MAMBA):
                self._mark([b for b in table.ids[:, :last].ravel().tolist() if b], BlockValue.HOT, 1.0)

    @staticmethod
    def _tables(managers: Sequence[SingleTypeManager],
                request_id: RequestId) -> Iterator[tuple[SingleTypeManager, Table]]:
        for manager in managers:
            table = manager.table_of.get(request_id)
            if table is not None:
                yield manager, table

    def _mark_at(self, request: KVRequest, point: int, kinds: set[AnchorKind]) -> None:
        point -= point % self._alignment
        if point <= 0:
            return
        key = self._key_at(request, point)
        if key is not None:
            self.rates.made_at(key, kinds)
        share = self.rates.share(kinds)
        for manager, table in self._tables(self._marked, request.request_id):
            if manager.anchor_checkpoint(request.request_id, point // manager.block_size - 1, BlockValue.ANCHOR, share):
                continue  # (its checkpoints are copies, not in the table)
            last = min(point // manager.block_size, table.length)
            if manager.group.kind is SpecKind.MAMBA:
                first = last - 1
            else:
                first = last - -(-(manager.group.window_tokens - 1) // manager.block_size)
            first = max(first, table.num_skipped, 0)
            if first < last:
                self._mark(table.ids[:, first:last].ravel().tolist(), BlockValue.ANCHOR, share)
