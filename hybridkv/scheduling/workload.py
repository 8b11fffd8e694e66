"""Workloads for `hybridkv run`: the built-in multi-turn chat, or a JSONL file.

JSONL format, one JSON object per line (blank lines and lines starting with `#` are skipped):

    {"prompt": "text"}                                  a single request
    {"prompt_token_ids": [2, 104, 105]}                 the same, as token ids
    {"session": "alice", "prompt": "...", "max_tokens": 16}
    {"prompt": "...", "cache_salt": "tenant-a"}         never shares a cached block with another salt

Lines that share a `session` are the turns of one conversation, in file order: turn k's prompt is
appended to turn k-1's prompt plus its generated tokens, so later turns extend earlier ones (and
hit the prefix cache). Turns run in rounds (round k = turn k of every session, batched); lines
without a session run in the first round. `max_tokens` defaults to the run's `--max-tokens`.

Pure Python: building the rounds needs the tokenizer only through the two callables passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridkv.errors import ConfigError
from hybridkv.plan import bounded_json

MAX_TOKEN_ID = 1 << 31  # token ids of a workload file (vocabularies hold at most a few hundred thousand)


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One line of a workload: text or token ids, an optional session, an optional length cap.

    `label` names the turn in errors and notes: `workload line 3` (1-based) or `built-in chat turn 2`.
    """

    session: str | None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    label: str = "turn"
    cache_salt: str | None = None


SYSTEM_PROMPT = (
    "You are a careful assistant for an infrastructure team. Answer briefly, cite the runbook "
    "section you used, and never run destructive commands without confirmation. The team runs "
    "a fleet of inference servers with hybrid attention models; each server keeps a KV cache "
    "split into sliding-window groups and full-attention groups. "
)
SESSIONS = (
    ("How do I drain a node?", "And how long does draining take?", "What if a request hangs?"),
    ("Why is TTFT high on node 7?", "Is the prefix cache hit rate low there?", "How do I warm it up?"),
    ("Explain the KV cache groups.", "Why do sliding layers use fewer blocks?", "What is the null block?"),
    ("Summarize yesterday's incident.", "Which alert fired first?", "Draft the postmortem title."),
    ("How much memory does a 32k context need?", "And with the uniform layout?", "Show the ratio."),
    ("Can we raise max_num_seqs?", "What happens on preemption?", "How do I see preemption counts?"),
)


def builtin_chat() -> list[Turn]:
    """Six sessions of three turns sharing one system prompt."""
    turns: list[Turn] = []
    for s, questions in enumerate(SESSIONS):
        for k, question in enumerate(questions):
            text = (SYSTEM_PROMPT if k == 0 else "") + f"\nUser: {question}\nAssistant:"
            turns.append(Turn(session=f"session-{s}", text=text, label=f"built-in chat turn {len(turns) + 1}"))
    return turns


def _turn(line_no: int, data: object) -> Turn:
    where = f"workload line {line_no}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"prompt", "prompt_token_ids", "session", "max_tokens", "cache_salt"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; expected prompt | prompt_token_ids, session, "
                          "max_tokens, cache_salt")
    text, ids = data.get("prompt"), data.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise ConfigError(f"{where}: give exactly one of 'prompt' (a string) or 'prompt_token_ids' (a list of ints)")
    if text is not None and (not isinstance(text, str) or not text):
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string, got {text!r}")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ConfigError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
    if ids is not None and not all(0 <= t < MAX_TOKEN_ID for t in ids):
        bad = next(t for t in ids if not 0 <= t < MAX_TOKEN_ID)
        raise ConfigError(f"{where}: 'prompt_token_ids' holds {bad!r:.40}; expected token ids in [0, 2**31)")
    session, max_tokens = data.get("session"), data.get("max_tokens")
    if session is not None and not isinstance(session, str):
        raise ConfigError(f"{where}: 'session' must be a string, got {session!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ConfigError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r:.40}")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ConfigError(f"{where}: 'cache_salt' must be a non-empty string, got {salt!r}")
    return Turn(session=session, text=text, token_ids=tuple(ids) if ids is not None else None, max_tokens=max_tokens,
                label=where, cache_salt=salt)


def load_jsonl(path: Path) -> list[Turn]:
    """The turns of a JSONL workload file; raises ConfigError naming the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        line_no = exc.object.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"workload {path} is not UTF-8 text (line {line_no}: byte {exc.object[exc.start]:#04x} at "
                          f"file offset {exc.start}); expected JSON lines in UTF-8") from None
    turns: list[Turn] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        data = bounded_json.loads_line(line, where=f"workload line {line_no}")
        turns.append(_turn(line_no, data))
    if not turns:
        raise ConfigError(f"workload {path} holds no requests; expected one JSON object per line")
    return turns


def rounds(turns: Sequence[Turn]) -> list[list[Turn]]:
    """Turns grouped into rounds: round k holds turn k of every session (sessionless: round 0)."""
    out: list[list[Turn]] = []
    seen: dict[str, int] = {}
    for turn in turns:
        k = 0
        if turn.session is not None:
            k = seen.get(turn.session, 0)
            seen[turn.session] = k + 1
        while len(out) <= k:
            out.append([])
        out[k].append(turn)
    return out


class Conversation:
    """Turns -> prompt token ids, carrying each session's history (prompt + generated tokens)."""

    def __init__(self, encode: Callable[[str], list[int]], continue_text: Callable[[str], list[int]]) -> None:
        self._encode = encode
        self._continue = continue_text
        self._history: dict[str, list[int]] = {}

    def prompt(self, turn: Turn) -> list[int]:
        history = self._history.get(turn.session, []) if turn.session is not None else []
        if turn.token_ids is not None:
            new = list(turn.token_ids)
        else:
            assert turn.text is not None
            new = self._continue(turn.text) if history else self._encode(turn.text)
        return history + new

    def record(self, turn: Turn, prompt: list[int], generated: list[int]) -> None:
        if turn.session is not None:
            self._history[turn.session] = prompt + generated
