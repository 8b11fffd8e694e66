"""probe.py's hit from few probes equals rules.py's hit over whole arrays (the reference), and the
native parse of `token_ids` equals json's."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.index.native import native_split_array, native_u32_array
from hybridkv.index.probe import PromptBlocks, instance_hit
from hybridkv.index.rules import GroupRule, RuleKind, attention_tokens, joint_hit_tokens

LAYOUTS = {
    "full": [GroupRule(kind=RuleKind.FULL, block_size=4)],
    "full+sliding": [GroupRule(kind=RuleKind.FULL, block_size=4),
                     GroupRule(kind=RuleKind.SLIDING, block_size=4, window_tokens=9)],
    "full+state": [GroupRule(kind=RuleKind.FULL, block_size=4), GroupRule(kind=RuleKind.STATE, block_size=8)],
    "sliding-only": [GroupRule(kind=RuleKind.SLIDING, block_size=4, window_tokens=6)],
    "full+sliding+state": [GroupRule(kind=RuleKind.FULL, block_size=4),
                           GroupRule(kind=RuleKind.SLIDING, block_size=8, window_tokens=20),
                           GroupRule(kind=RuleKind.STATE, block_size=4)],
    "full+never": [GroupRule(kind=RuleKind.FULL, block_size=4), GroupRule(kind=RuleKind.NEVER, block_size=4)],
}


def _held(rng: random.Random, rule: GroupRule, n: int) -> list[bool]:
    """A full group holds a prefix (tail-first eviction); the others hold any blocks."""
    if rule.kind is RuleKind.FULL:
        end = rng.randrange(n + 1)
        return [i < end for i in range(n)]
    p = rng.random()
    return [rng.random() < p for _ in range(n)]


def _table(rules: list[GroupRule], held: list[list[bool]], size: int) -> Callable[[int, int], int]:
    """The table's probe for the blocks of one size, keyed by block index."""
    def get(key: int, default: int) -> int:
        return sum(1 << g for g, r in enumerate(rules) if r.block_size == size and held[g][key]) or default
    return get


@pytest.mark.parametrize("layout", LAYOUTS)
def test_probed_hit_equals_the_reference(layout: str) -> None:
    rng = random.Random(layout)
    rules = LAYOUTS[layout]
    for _ in range(300):
        num_tokens = rng.randrange(1, 120)
        held = [_held(rng, r, num_tokens // r.block_size) for r in rules]
        groups = [(rule, 1 << g) for g, rule in enumerate(rules)]  # (one slot per group: bit g)
        blocks = {size: PromptBlocks(list(range(num_tokens // size)), _table(rules, held, size))
                  for size in {r.block_size for r in rules}}
        want = (joint_hit_tokens(rules, [np.array(h, dtype=np.bool_) for h in held], num_tokens - 1),
                attention_tokens(rules, [np.array(h, dtype=np.bool_) for h in held]))
        assert instance_hit(groups, blocks, num_tokens - 1) == want, (num_tokens, held)


def test_a_held_32k_prompt_takes_a_few_dozen_probes() -> None:
    """A 2048-block prompt: an attention prefix and a state checkpoint every 16 blocks up to block
    2000; the hit from a binary search for the prefix's end and a walk down to a checkpoint."""
    state_held = set(range(15, 2000, 16))
    groups = [(GroupRule(kind=RuleKind.FULL, block_size=16), 0b01),
              (GroupRule(kind=RuleKind.STATE, block_size=16), 0b10)]
    for attention_end, hit_blocks, most_probes in ((2048, 2000, 2048 - 1999), (1500, 1488, 12 + 1500 - 1487)):
        probes: list[int] = []

        def get(key: int, default: int, end: int = attention_end, seen: list[int] = probes) -> int:
            seen.append(key)
            return (0b01 if key < end else 0) | (0b10 if key in state_held else 0)

        blocks = {16: PromptBlocks(list(range(2048)), get)}
        assert instance_hit(groups, blocks, 32768) == (hit_blocks * 16, attention_end * 16)
        assert len(probes) <= most_probes, probes
        assert len(probes) == len(set(probes))  # (each block probed once)


def test_native_parse_equals_json() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(1 << 32) for _ in range(5000)] + [0, 4294967295]
    for text in (json.dumps(ids), json.dumps(ids, indent=1), "[]", " [ 7 ] \n"):
        data = native_u32_array(text.encode())
        if data is None:
            pytest.skip("no C compiler: the index decodes token ids with msgspec")
        assert np.frombuffer(data, dtype="<u4").tolist() == json.loads(text)


@pytest.mark.parametrize("sep", [",", ", "])
def test_native_parse_equals_json_across_block_edges(sep: str) -> None:
    """The common spellings (json.dumps' and the compact one) are read 64 bytes at a time
    (json_u32.c): every count of 0 to 120 numbers of 1 to 8 digits (numbers cross block edges at
    every offset, the array ends in a block and in the padded tail), a leading zero or a number over u32
    anywhere, all as json reads them."""
    rng = random.Random(1)
    for count in range(121):
        ids = [rng.randrange(10 ** rng.randrange(1, 9)) for _ in range(count)]
        text = "[" + sep.join(map(str, ids)) + "]"
        data = native_u32_array(text.encode())
        if data is None:
            pytest.skip("no C compiler: the index decodes token ids with msgspec")
        assert np.frombuffer(data, dtype="<u4").tolist() == ids, text
        if ids:
            at = rng.randrange(len(ids))
            for bad in (f"0{ids[at]}", f"{ids[at]}9999999999"):  # (refused: json reads neither as a u32)
                words = [*map(str, ids[:at]), bad, *map(str, ids[at + 1:])]
                assert native_u32_array(("[" + sep.join(words) + "]").encode()) is None


_SEPARATORS = [",", ", ", " ,", ",\n  ", " , ", ",\t"]


@st.composite
def _arrays(draw: st.DrawFn) -> tuple[str, list[int] | None]:
    """A JSON array of u32s as clients write it (any separators, numbers of 1 to 10 digits, often long
    enough for the two-chain read), perhaps with one character replaced, inserted or dropped; and
    the ids it holds when it still is such an array (json's reading), else None."""
    digits = draw(st.integers(1, 10))
    size = draw(st.sampled_from([0, 1, 2, 9, 1500, 3000]))  # (over ~4 KB of text: two chains)
    ids = draw(st.lists(st.integers(0, min(10**digits - 1, 0xFFFFFFFF)), min_size=size, max_size=size))
    sep = draw(st.sampled_from(_SEPARATORS))
    text = "[" + sep.join(map(str, ids)) + "]"
    edit = draw(st.sampled_from(["none", "replace", "insert", "drop"]))
    if edit != "none" and len(text) > 2:
        at = draw(st.integers(1, len(text) - 2))
        char = draw(st.sampled_from(list("0123456789, ]-.e[x")))
        text = {"replace": text[:at] + char + text[at + 1:], "insert": text[:at] + char + text[at:],
                "drop": text[:at] + text[at + 1:]}[edit]
    try:
        want = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    ok = isinstance(want, list) and all(type(v) is int and 0 <= v <= 0xFFFFFFFF for v in want)
    return text, want if ok else None


@settings(max_examples=400, deadline=None)
@given(_arrays())
def test_native_parse_equals_json_on_any_array(case: tuple[str, list[int] | None]) -> None:
    text, want = case
    data = native_u32_array(text.encode())
    if data is None:  # (refused, then read by the decoder: only what json rejects or reads as other than u32s,
        # and -0, which json reads as 0)
        assert want is None or "-0" in text, text
        return
    assert want is not None and np.frombuffer(data, dtype="<u4").tolist() == want


@pytest.mark.parametrize("text", ["[-1]", "[1.0]", "[1e3]", "[01]", "[4294967296]", "[1,]", "[1 2]", "[1", "[1]x",
                                  '["1"]', "[99999999999999999999]", "{}", ""])
def test_native_parse_refuses_what_json_u32_would_not_give(text: str) -> None:
    assert native_u32_array(text.encode()) is None


@pytest.mark.parametrize("text", [
    '{"model": "m", "token_ids": [1, 2, 3]}',
    ' {"token_ids":[7],"model":"a]}\\"[{","x":{"token_ids":[9],"y":["]",{"z":"}"}]},"n":null} ',
    '{"model": "m", "cache_salt": "s\\\\", "token_ids": [], "block_size": 16}',
])
def test_the_native_split_finds_the_top_level_array(text: str) -> None:
    split = native_split_array(text.encode(), b"token_ids")
    if split is None:
        pytest.skip("no C compiler: the index decodes token ids with msgspec")
    rest, data = split
    want = json.loads(text)
    assert np.frombuffer(data, dtype="<u4").tolist() == want.pop("token_ids")
    got = json.loads(rest)
    assert got.pop("token_ids") == [] and got == want


@pytest.mark.parametrize("text", [
    '{"model": "m"}', '{"token_ids": [1], "token_ids": [2]}', '{"token\\u005fids": [1]}', '{"token_ids": [1]',
    '{"token_ids": [1]} x', '[1, 2]', '{"token_ids": "abc"}', '{"token_ids": [-1]}', '{"a": "unterminated}',
])
def test_the_native_split_leaves_anything_unusual_to_the_decoder(text: str) -> None:
    assert native_split_array(text.encode(), b"token_ids") is None
