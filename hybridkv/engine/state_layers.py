"""State layers on the paged KV cache: recurrent state of Mamba1 / Mamba2 / Gated DeltaNet mixers.

A state layer keeps, per request, a fixed-size state instead of K/V per token. The planner gives
every state group the same page size as the attention groups (the state padded up to it); a
state block is one page in each of the group's tensors, and a layer views its page as its state
tensors, in `MambaSpec.shapes` order, each at the byte offset where the previous one ends:

    page b of the layer's tensor:  | conv (K-1, C), model dtype | recurrent (...), mamba_ssm_dtype | padding |
    StateCache.conv       [num_blocks, K-1, C]       (strided over the pages, so writes land in the pool)
    StateCache.recurrent  [num_blocks, *shape]       (Gated DeltaNet: [Hv, Dv, Dk]; Mamba2: [H, P, N])

Which block holds which state comes from the KV cache manager (`KVCacheManager.state_steps`,
carried to the runner as one `StateIO` per request and state group): the block the step reads
its state from and the (tokens, block) of every state it writes, the last being the running
state after the step. Before the forward, for each request (`StateLayers.prepare`):

    read is None (position 0)        the running block is zeroed (a fresh state)
    read != running block            the read block is copied into the running block (a prefix
                                     hit restores its checkpoint this way; so does a decode that
                                     moves to a new block)
    read == running block            the state is advanced in place

ALIGN mode writes one state per step (the scheduler ends prefill chunks on block boundaries so
it is a checkpoint); ALL mode also one per block boundary the step crosses, all from the same
forward (the chunk's `checkpoints`). A block restored from by one request and written by another
in the same step is an internal error (the manager defers such hits to the next step).
so a mixer always reads and writes one block per sequence, plus the checkpoint blocks it is
told about. `StateLayers.restore_hook` (tests only) sees every restored block after the copy.

The mixer interface. A state mixer is an `nn.Module` of the model; in its forward it gets

    cache = ctx.state_cache(layer)     # StateCache: .conv, .recurrent views over the pages
    meta  = ctx.state_metadata(layer)  # StateMetadata of the layer's group for this step

The step's T flattened tokens are: first `meta.num_decodes` single-token sequences (decodes,
their running blocks in `meta.decode_blocks`), then one `StateSequence` per multi-token chunk
(`token_start`, `num_tokens`, running `block`, `checkpoints` = (tokens into the chunk, block)).
A mixer computes its outputs [T, ...] and stores, for every sequence, the state after its last
token in its running block and the state after each checkpoint offset in that checkpoint's
block. Two helpers do the bookkeeping, so a mixer only writes its math:

    out = causal_conv(x [T, C], cache.conv, meta, weight [C, K], bias)     # depthwise causal conv,
                                                                            # conv states stored
    out = scan_states(meta, cache.recurrent, inputs=(a [T, ...], b [T, ...], ...),
                      step=fn(inputs [D, ...], state [D, *S]) -> (out [D, ...], state [D, *S]),
                      scan=fn(inputs [n, ...], state [*S]) -> (out [n, ...], state [*S]))

`step` advances all decodes by one token at once; `scan` runs one segment of one chunk (a
chunked scan) from its initial state; `scan_states` splits each chunk at its checkpoints, so
every checkpoint state comes from the same forward, and writes the states into the pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridkv.engine import kernels
from hybridkv.engine.threads import kernel_threads
from hybridkv.errors import ConfigError
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import MambaSpec, MambaType, SpecKind


@dataclass(frozen=True, slots=True, kw_only=True)
class StateCache:
    """One state layer's views over the page bytes of its tensor (block b = page b)."""

    conv: torch.Tensor  # [num_blocks, K-1, C]
    recurrent: torch.Tensor  # [num_blocks, *shape] ([num_blocks, 0, C] for a short convolution: none)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSequence:
    """One multi-token chunk of a step in one state group.

    Its tokens are the flattened tokens [token_start, token_start + num_tokens). `checkpoints`
    lists (offset, block): the state after the chunk's first `offset` tokens (0 < offset <
    num_tokens, increasing) is also stored in `block`.
    """

    token_start: int
    num_tokens: int
    block: int
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StateMetadata:
    """A state group's part of one step: decodes first, then the multi-token chunks."""

    num_decodes: int
    decode_blocks: torch.Tensor  # [num_decodes] int64 running block of each decode
    sequences: tuple[StateSequence, ...]
    # the same as the native scans read it (`engine/kernels/state_scan.c`), built once per step:
    plan: torch.Tensor = field(init=False)  # [D + S, 5] int64: (first token, tokens, block, checkpoints from, to)
    plan_checkpoints: torch.Tensor = field(init=False)  # [K, 2] int64: (tokens into the sequence, block)

    def __post_init__(self) -> None:
        rows = [(i, 1, block, 0, 0) for i, block in enumerate(self.decode_blocks.tolist())]
        points: list[tuple[int, int]] = []
        for seq in self.sequences:
            rows.append((seq.token_start, seq.num_tokens, seq.block, len(points), len(points) + len(seq.checkpoints)))
            points.extend(seq.checkpoints)
        object.__setattr__(self, "plan", torch.tensor(rows, dtype=torch.int64).view(-1, 5))
        object.__setattr__(self, "plan_checkpoints", torch.tensor(points, dtype=torch.int64).view(-1, 2))


def _torch_dtype(name: str, layer: int) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"layer {layer}: state dtype {name!r} is not a torch dtype; expected e.g. float32")
    return dtype


def state_view(buffer: torch.Tensor, *, spec: MambaSpec, num_blocks: int, page_bytes: int,
               layer: int) -> StateCache:
    """The state tensors of `spec` over `buffer` (one KV cache tensor: num_blocks pages of page_bytes)."""
    conv_only = spec.mamba_type is MambaType.SHORT_CONV
    if len(spec.shapes) != (1 if conv_only else 2):
        raise ConfigError(f"layer {layer}: a {spec.mamba_type.value} state layer needs a conv state"
                          f"{'' if conv_only else ' and a recurrent state'}, got {len(spec.shapes)} state tensors")
    if spec.state_bytes > page_bytes:
        raise ConfigError(f"layer {layer}: state of {spec.state_bytes} bytes exceeds the page of {page_bytes} bytes")
    views: list[torch.Tensor] = []
    offset = 0
    for shape, name in zip(spec.shapes, spec.dtypes, strict=True):
        dtype = _torch_dtype(name, layer)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or page_bytes % itemsize:
            raise ConfigError(f"layer {layer}: state tensor {shape} of {name} starts at byte {offset} of a "
                              f"{page_bytes}-byte page; expected a multiple of {itemsize}")
        typed = buffer.view(dtype)  # [num_blocks * page / itemsize]
        inner = torch.empty(shape).stride()
        views.append(typed.as_strided((num_blocks, *shape), (page_bytes // itemsize, *inner), offset // itemsize))
        offset += math.prod(shape) * itemsize
    # a short convolution (LFM2) keeps no recurrent state: an empty view
    return StateCache(conv=views[0], recurrent=views[1] if len(views) > 1 else views[0][:, :0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StateIO:
    """Where one request's step [start, end) reads and writes one state group's state.

    `read`: the block holding the state after `start` tokens (None: start == 0, a zero state).
    `writes`: (tokens, block) of every state the step stores, ascending; the last is the state
    after `end` tokens (the running block). The KV cache manager's `state_steps` says this.
    """

    read: int | None
    writes: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.writes:
            raise RuntimeError("internal error: a state step must write at least its final state")


class StateLayers:
    """Views of every state layer and, per step, each state group's metadata and restore copies."""

    def __init__(self, kv_config: KVCacheConfig, buffers: Sequence[torch.Tensor]) -> None:
        self.kv_config = kv_config
        # page groups 1.. of a multi-page state follow page group 0 (`state_pages.py` gathers their pages)
        self.groups = [g for g in kv_config.groups if g.kind is SpecKind.MAMBA and g.state_lead]
        # [blocks, page]; a layout of mixed pages (no state groups) has one tensor per layer, of its own page
        self._pages = [b.view(kv_config.num_blocks, -1) for b in buffers]
        self.restore_hook: Callable[[KVCacheGroupSpec, list[int]], None] | None = None  # tests only

    def view(self, buffer: torch.Tensor, group: KVCacheGroupSpec, layer: int) -> StateCache:
        assert isinstance(group.spec, MambaSpec)
        return state_view(buffer, spec=group.spec, num_blocks=self.kv_config.num_blocks,
                          page_bytes=self.kv_config.page_size_bytes, layer=layer)

    def prepare(self, spans: Sequence[tuple[int, int]], io: Sequence[Mapping[int, StateIO]],
                pages: Mapping[int, Sequence[torch.Tensor]] | None = None) -> dict[int, StateMetadata]:
        """Restore copies, zeroing, and the metadata of every state group for one step.

        `spans[i]` = (start_pos, end_pos) of item i in flattened order (decodes first); `io[i][g]`
        where it reads and writes group g's state. `pages[g]`: the [slots, state bytes] tensors group
        g's states are in this step instead of the KV cache tensors (a multi-page state's scratch).
        """
        out: dict[int, StateMetadata] = {}
        for group in self.groups:
            g = group.group_id
            missing = [i for i, known in enumerate(io) if g not in known]
            if missing:
                raise RuntimeError(f"internal error: step items {missing} do not say where state group {g} is "
                                   f"read and written (StepItem.state_io, from KVCacheManager.state_steps)")
            out[g] = self._prepare_group(group, spans, [known[g] for known in io], (pages or {}).get(g))
        return out

    def _prepare_group(self, group: KVCacheGroupSpec, spans: Sequence[tuple[int, int]],
                       steps: Sequence[StateIO], pages: Sequence[torch.Tensor] | None) -> StateMetadata:
        sources: list[int] = []
        targets: list[int] = []
        fresh: list[int] = []
        decodes: list[int] = []
        sequences: list[StateSequence] = []
        writer: dict[int, int] = {}  # block -> the request that writes a state into it this step
        reader: dict[int, int] = {}  # block -> the request that restores from it
        token = 0
        for i, ((start, end), step) in enumerate(zip(spans, steps, strict=True)):
            final_tokens, running = step.writes[-1]
            if final_tokens != end or any(t <= start for t, _ in step.writes):
                raise RuntimeError(f"internal error: state writes {step.writes} do not fit the step [{start}, {end})")
            writer.update((b, i) for _, b in step.writes)
            if step.read is None:
                fresh.append(running)
            elif step.read != running:
                sources.append(step.read)
                targets.append(running)
                reader[step.read] = i
            n = end - start
            if n == 1:
                decodes.append(running)
            else:
                points = tuple((t - start, b) for t, b in step.writes[:-1])
                sequences.append(StateSequence(token_start=token, num_tokens=n, block=running, checkpoints=points))
            token += n
        clash = sorted(b for b, i in reader.items() if writer.get(b, i) != i)
        if clash:
            raise RuntimeError(f"internal error: state blocks {clash} are restored from by one request and written by "
                               f"another in the same step; a checkpoint cached in a step must not be hit in that step")
        self._copy(group, sources, targets, fresh, pages)
        return StateMetadata(num_decodes=len(decodes), decode_blocks=torch.tensor(decodes, dtype=torch.int64),
                             sequences=tuple(sequences))

    def _copy(self, group: KVCacheGroupSpec, sources: list[int], targets: list[int], fresh: list[int],
              pages: Sequence[torch.Tensor] | None) -> None:
        if pages is None:
            pages = self._pages[: len(group.layer_indices)]  # tensor i holds layer i of every group
        if sources:
            src, dst = torch.tensor(sources), torch.tensor(targets)
            for page in pages:
                page.index_copy_(0, dst, page.index_select(0, src))
        if fresh:
            index = torch.tensor(fresh)
            for page in pages:
                page.index_fill_(0, index, 0)
        if self.restore_hook is not None and targets:
            self.restore_hook(group, targets)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata, weight: torch.Tensor,
                bias: torch.Tensor | None, *, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(depthwise causal conv1d) of the step's inputs x [T, C] (kernel weight [C, K]).

    Each sequence continues from the K-1 inputs stored in its running block (zeros for a fresh
    one); the last K-1 inputs after the chunk (and after each checkpoint offset) are stored back.
    float32 runs in one native call (`kernels.causal_conv`: SiLU fused, other activations after).
    """
    taps = weight.t().contiguous()  # [K, C]: as K shifted multiply-adds, 5x faster than F.conv1d here
    if kernels.usable(x, conv_state, taps):
        fused = act is F.silu
        out = kernels.causal_conv(x, conv_state, taps, None if bias is None else bias.float(), meta.plan,
                                  meta.plan_checkpoints, silu=fused, threads=kernel_threads())
        return out if fused else act(out)
    return act(_causal_conv(x, conv_state, meta, taps, bias))


def _causal_conv(x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata, taps: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """`causal_conv` before the activation, in plain torch (taps [K, C])."""
    kernel = taps.shape[0]
    out = torch.empty_like(x)
    d = meta.num_decodes
    if d:
        blocks = meta.decode_blocks  # index_select / index_copy_: ~4x faster than [blocks] indexing here
        window = torch.cat([conv_state.index_select(0, blocks).to(x.dtype), x[:d, None, :]], dim=1)  # [D, K, C]
        torch.sum(window * taps, dim=1, out=out[:d])  # one multiply and one sum: fewer ops than K shifted ones
        if bias is not None:
            out[:d] += bias
        conv_state.index_copy_(0, blocks, window[:, 1:].to(conv_state.dtype))
    for seq in meta.sequences:
        a, n = seq.token_start, seq.num_tokens
        window = torch.cat([conv_state[seq.block].to(x.dtype), x[a : a + n]], dim=0)  # [K-1+n, C]
        _shifted_sum([window[j : j + n] for j in range(kernel)], taps, bias, out=out[a : a + n])
        for offset, block in seq.checkpoints:
            conv_state[block] = window[offset : offset + kernel - 1].to(conv_state.dtype)
        conv_state[seq.block] = window[n : n + kernel - 1].to(conv_state.dtype)
    return out


def _shifted_sum(shifted: Sequence[torch.Tensor], taps: torch.Tensor, bias: torch.Tensor | None, *,
                 out: torch.Tensor) -> None:
    """out [n, C] = sum_j shifted[j] [n, C] * taps[j] [C] (+ bias [C]): a depthwise conv, tap by tap."""
    torch.mul(shifted[0], taps[0], out=out)
    for j in range(1, len(shifted)):
        out.addcmul_(shifted[j], taps[j])
    if bias is not None:
        out.add_(bias)


StepFn = Callable[[Sequence[torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def scan_states(meta: StateMetadata, states: torch.Tensor, inputs: Sequence[torch.Tensor], *,
                step: StepFn, scan: StepFn) -> torch.Tensor:
    """Run a recurrence over the step's sequences, reading and writing `states` [num_blocks, *S].

    inputs: per-token tensors [T, ...]. `step(inputs [D, ...], states [D, *S])` advances every
    decode by one token (`states` is a fresh copy: the step may update it in place);
    `scan(inputs [n, ...], state [*S])` runs one segment of a chunk. Both return (outputs, new
    states); the outputs are assembled into one tensor [T, ...].
    """
    pieces: list[torch.Tensor] = []
    d = meta.num_decodes
    if d:
        blocks = meta.decode_blocks
        out, new = step([t[:d] for t in inputs], states.index_select(0, blocks).float())
        states.index_copy_(0, blocks, new.to(states.dtype))
        pieces.append(out)
    for seq in meta.sequences:
        state = states[seq.block].float()
        begin = seq.token_start
        ends = [(seq.token_start + offset, block) for offset, block in seq.checkpoints]
        ends.append((seq.token_start + seq.num_tokens, seq.block))
        for end, block in ends:
            out, state = scan([t[begin:end] for t in inputs], state)
            states[block] = state.to(states.dtype)
            pieces.append(out)
            begin = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
