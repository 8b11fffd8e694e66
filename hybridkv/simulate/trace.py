"""A trace for `hybridkv simulate`, and its two file formats.

A trace is a list of `TraceRequest`s in arrival order. A request's prompt is its `parent`'s whole
sequence (the parent's prompt plus the tokens it generated) followed by `new_tokens`, or
`new_tokens` alone without a parent: a chat turn extends the previous turn, a branch extends any
earlier request. A request arrives at `arrival_ms`, and never before its parent finished.

Formats (one JSON object per line):

- our JSONL workload (`hybridkv run --workload`): `prompt` (text, read as UTF-8 bytes) or
  `prompt_token_ids`, optional `session`, `max_tokens`, `cache_salt`. Turns of a session extend
  each other; every first turn arrives at 0 ms.
- Mooncake (FAST'25 traces): `timestamp` (ms), `input_length`, `output_length`, `hash_ids`: one id
  per `block_tokens`-token block of the prompt, equal ids = equal content, the last block may be
  partial. Block id h becomes the tokens `h * block_tokens + i`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hybridkv.errors import ConfigError
from hybridkv.plan import bounded_json
from hybridkv.scheduling.workload import load_jsonl

DEFAULT_OUTPUT_TOKENS = 16
# What a Mooncake trace line may say (a bigger value is a broken file, refused naming the field):
MAX_BLOCK_TOKENS = 1 << 20  # --trace-block-tokens (the public traces use 512)
MAX_PROMPT_TOKENS = 1 << 22  # input_length: 4M tokens
MAX_OUTPUT_TOKENS = 1 << 31  # output_length
MAX_TIMESTAMP_MS = float(1 << 53)  # timestamp: exact in a double (285,000 years)
MAX_HASH_ID = 1 << 32  # hash_ids


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a trace (module docstring)."""

    arrival_ms: float
    new_tokens: tuple[int, ...]
    output_tokens: int
    parent: int | None = None  # index of an earlier request whose whole sequence this prompt extends
    cache_salt: str | None = None
    #: positions in `new_tokens` where a chat message ends before the prompt's end (a system prompt, a
    #: tool spec): what a chat template tells the server (`SimOptions.turn_checkpoints`)
    turn_ends: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ConfigError(f"a trace request must generate at least 1 token, got output_tokens={self.output_tokens}")
        if self.parent is None and not self.new_tokens:
            raise ConfigError("a trace request without a parent needs at least one prompt token")
        if self.arrival_ms < 0:
            raise ConfigError(f"arrival time must be >= 0 ms, got {self.arrival_ms}")
        ends = self.turn_ends
        if any(not 0 < p < len(self.new_tokens) for p in ends) or list(ends) != sorted(set(ends)):
            raise ConfigError(f"turn_ends must be increasing positions inside the {len(self.new_tokens)} new "
                              f"tokens (1..{len(self.new_tokens) - 1}), got {ends[:8]}")


class TraceFormat(Enum):
    """How `read_trace` parses a file (AUTO: Mooncake when the first record has `hash_ids`)."""

    AUTO = "auto"
    WORKLOAD = "workload"
    MOONCAKE = "mooncake"


def read_trace(path: Path, *, trace_format: TraceFormat = TraceFormat.AUTO, block_tokens: int = 512,
               default_output_tokens: int = DEFAULT_OUTPUT_TOKENS) -> list[TraceRequest]:
    """The requests of a trace file; `ConfigError` naming the line for bad input."""
    if trace_format is TraceFormat.AUTO:
        trace_format = TraceFormat.MOONCAKE if _first_record_has(path, "hash_ids") else TraceFormat.WORKLOAD
    if trace_format is TraceFormat.MOONCAKE:
        return read_mooncake(path, block_tokens=block_tokens)
    return read_workload(path, default_output_tokens=default_output_tokens)


def _first_record_has(path: Path, key: str) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.lstrip().startswith("#"):
                    data = bounded_json.loads_line(line, where="trace line 1")
                    return isinstance(data, dict) and key in data
    except (OSError, UnicodeDecodeError, ConfigError):
        return False  # the chosen reader reports the problem with its line
    return False


def read_workload(path: Path, *, default_output_tokens: int = DEFAULT_OUTPUT_TOKENS) -> list[TraceRequest]:
    """Our JSONL workload: sessions become parent chains; text prompts are UTF-8 bytes."""
    last_of_session: dict[str, int] = {}
    out: list[TraceRequest] = []
    for turn in load_jsonl(path):
        tokens = turn.token_ids if turn.token_ids is not None else tuple((turn.text or "").encode("utf-8"))
        parent = last_of_session.get(turn.session) if turn.session is not None else None
        if turn.session is not None:
            last_of_session[turn.session] = len(out)
        out.append(TraceRequest(arrival_ms=0.0, new_tokens=tuple(tokens), parent=parent,
                                output_tokens=turn.max_tokens or default_output_tokens, cache_salt=turn.cache_salt))
    return out


def read_mooncake(path: Path, *, block_tokens: int = 512) -> list[TraceRequest]:
    """A Mooncake trace: prompts built from `hash_ids` (module docstring), arrival = `timestamp`."""
    if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise ConfigError(f"--trace-block-tokens must be an integer in [1, {MAX_BLOCK_TOKENS}], got {block_tokens}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    out: list[TraceRequest] = []
    blocks: dict[int, tuple[int, ...]] = {}  # hash id -> its tokens, one copy shared by every prompt that has it
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"trace line {line_no}"
        data = bounded_json.loads_line(line, where=where)
        out.append(_mooncake_request(data, where, block_tokens, blocks))
    if not out:
        raise ConfigError(f"trace {path} holds no requests; expected one JSON object per line")
    start = min(r.arrival_ms for r in out)
    return sorted((TraceRequest(arrival_ms=r.arrival_ms - start, new_tokens=r.new_tokens,
                                output_tokens=r.output_tokens) for r in out), key=lambda r: r.arrival_ms)


def _mooncake_request(data: object, where: str, block_tokens: int,
                      blocks: dict[int, tuple[int, ...]]) -> TraceRequest:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    fields = {}
    for key, most in (("timestamp", MAX_TIMESTAMP_MS), ("input_length", MAX_PROMPT_TOKENS),
                      ("output_length", MAX_OUTPUT_TOKENS)):
        value = data.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= most:
            raise ConfigError(f"{where}: {key!r} must be a number in [0, {most}], got {value!r:.40}")
        fields[key] = value
    ids = data.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ConfigError(f"{where}: 'hash_ids' must be a list of integers in [0, 2**32), got {ids!r:.80}")
    bad = next((h for h in ids if not 0 <= h < MAX_HASH_ID), None)
    if bad is not None:
        raise ConfigError(f"{where}: 'hash_ids' holds {bad!r:.40}; expected integers in [0, 2**32)")
    length = int(fields["input_length"])
    if length < 1 or not (len(ids) - 1) * block_tokens < length <= len(ids) * block_tokens:
        raise ConfigError(
            f"{where}: input_length {length} does not match {len(ids)} hash_ids of {block_tokens} tokens; expected "
            f"{(len(ids) - 1) * block_tokens + 1}..{len(ids) * block_tokens} (set --trace-block-tokens)"
        )
    # the token objects of a block are made once (a 27M-token trace of shared blocks keeps one int per
    # distinct token, not one per prompt position)
    tokens = [t for h in ids for t in _block(blocks, h, block_tokens)][:length]
    return TraceRequest(arrival_ms=float(fields["timestamp"]), new_tokens=tuple(tokens),
                        output_tokens=max(1, int(fields["output_length"])))


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthCuts:
    """What `--max-model-len` cuts from a trace, as the simulator replays it: a prompt (with its
    parent's whole sequence) keeps its first `max_model_len - 1` tokens, and a request stops
    generating when its sequence reaches `max_model_len` tokens."""

    max_model_len: int
    prompts_cut: int
    longest_prompt_tokens: int  # before the cut
    outputs_capped: int
    largest_output_tokens: int  # asked for, before the cap

    def message(self) -> str | None:
        """One line for stderr, or None when nothing was cut."""
        parts = []
        if self.prompts_cut:
            parts.append(f"{self.prompts_cut} prompt(s) cut to {self.max_model_len - 1} tokens (the longest had "
                         f"{self.longest_prompt_tokens})")
        if self.outputs_capped:
            parts.append(f"{self.outputs_capped} output(s) stopped at {self.max_model_len} tokens of sequence (the "
                         f"largest asked for {self.largest_output_tokens} tokens)")
        return f"note: --max-model-len {self.max_model_len}: {'; '.join(parts)}" if parts else None


def length_cuts(trace: list[TraceRequest], max_model_len: int) -> LengthCuts:
    sequence: list[int] = []  # each request's sequence length after the simulator's cuts
    prompts_cut = outputs_capped = longest = largest = 0
    for r in trace:
        full = (sequence[r.parent] if r.parent is not None else 0) + len(r.new_tokens)
        prompt = min(full, max_model_len - 1)
        if full > prompt:
            prompts_cut, longest = prompts_cut + 1, max(longest, full)
        if prompt + r.output_tokens > max_model_len:
            outputs_capped, largest = outputs_capped + 1, max(largest, r.output_tokens)
        sequence.append(min(prompt + r.output_tokens, max_model_len))
    return LengthCuts(max_model_len=max_model_len, prompts_cut=prompts_cut, longest_prompt_tokens=longest,
                      outputs_capped=outputs_capped, largest_output_tokens=largest)


def _block(blocks: dict[int, tuple[int, ...]], hash_id: int, block_tokens: int) -> tuple[int, ...]:
    found = blocks.get(hash_id)
    if found is None:
        found = blocks[hash_id] = tuple(range(hash_id * block_tokens, (hash_id + 1) * block_tokens))
    return found


def mooncake_records(trace: Sequence[TraceRequest], *, block_tokens: int = 512) -> list[dict[str, object]]:
    """`trace` as Mooncake records (module docstring), in trace order: each prompt written out whole (a
    parent's sequence is its prompt and then `output_tokens` generated tokens, distinct per request),
    cut into `block_tokens` blocks, each block numbered by its content and everything before it (equal
    ids = equal prefix content; the last block may be partial). Read back with `read_mooncake`, prompts
    share exactly the whole blocks the trace's prompts share."""
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be a positive integer, got {block_tokens}")
    parents = {r.parent for r in trace if r.parent is not None}
    sequences: dict[int, tuple[int, ...]] = {}  # whole sequences of the requests a later one extends
    ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (previous block's id or -1, block tokens) -> id
    out: list[dict[str, object]] = []
    for index, request in enumerate(trace):
        if request.parent is not None and not 0 <= request.parent < index:
            raise ConfigError(f"trace request {index} names parent {request.parent}; expected an earlier request")
        prompt = (sequences[request.parent] if request.parent is not None else ()) + request.new_tokens
        if index in parents:
            sequences[index] = prompt + tuple(-(index * 65_536 + i) - 1 for i in range(request.output_tokens))
        hash_ids: list[int] = []
        for start in range(0, len(prompt), block_tokens):
            key = (hash_ids[-1] if hash_ids else -1, prompt[start : start + block_tokens])
            hash_ids.append(ids.setdefault(key, len(ids)))
        out.append({"timestamp": round(request.arrival_ms), "input_length": len(prompt),
                    "output_length": request.output_tokens, "hash_ids": hash_ids})
    return out


def write_mooncake(trace: Sequence[TraceRequest], path: Path, *, block_tokens: int = 512) -> None:
    """Write `mooncake_records(trace)` to `path`, one JSON object per line."""
    lines = (json.dumps(record) + "\n" for record in mooncake_records(trace, block_tokens=block_tokens))
    try:
        path.write_text("".join(lines), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write trace {path}: {exc}") from None
