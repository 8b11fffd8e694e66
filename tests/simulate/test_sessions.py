"""The production-like session generator (`simulate/sessions.py`): structure checked request by
request against a naive reconstruction, and the documented defaults' statistics."""

from __future__ import annotations

import itertools
import statistics

from hybridkv.simulate.generators import Generator, GeneratorOptions, generate
from hybridkv.simulate.sessions import SessionShape, sessions
from hybridkv.simulate.trace import TraceRequest

SEGMENT = 512


def prompts(trace: list[TraceRequest]) -> list[int]:
    """Each request's prompt length: its parent's prompt and output, then its new tokens."""
    out: list[int] = []
    for r in trace:
        parent = trace[r.parent] if r.parent is not None else None
        out.append((out[r.parent] + parent.output_tokens if parent is not None and r.parent is not None else 0)
                   + len(r.new_tokens))
    return out


def test_seeded_and_in_arrival_order() -> None:
    a = generate(Generator.SESSIONS, GeneratorOptions(num_requests=200, seed=3))
    assert a == generate(Generator.SESSIONS, GeneratorOptions(num_requests=200, seed=3))
    assert a != generate(Generator.SESSIONS, GeneratorOptions(num_requests=200, seed=4))
    assert len(a) == 200
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)


def test_turns_extend_earlier_turns_by_whole_segments() -> None:
    trace = generate(Generator.SESSIONS, GeneratorOptions(num_requests=400, seed=0))
    firsts = [r for r in trace if r.parent is None]
    turns = [r for r in trace if r.parent is not None]
    assert len(turns) > len(trace) // 2  # most requests continue a session
    for r in turns:
        assert r.parent is not None and trace[r.parent].arrival_ms <= r.arrival_ms
        whole = -(-len(r.new_tokens) // SEGMENT)  # the last segment may be partial
        assert (whole - 1) * SEGMENT < len(r.new_tokens) <= whole * SEGMENT
    # a first turn: one of 8 system prompts (whole segments, ending at its first turn_end), maybe a document
    systems = {r.new_tokens[: r.turn_ends[0]] for r in firsts}
    assert 1 < len(systems) <= 8
    assert all(len(s) % SEGMENT == 0 for s in systems)
    assert all(all(e % SEGMENT == 0 for e in r.turn_ends) for r in firsts)
    with_document = [r for r in firsts if len(r.turn_ends) == 2]
    assert 0.4 < len(with_document) / len(firsts) < 0.8  # document_probability 0.6


def test_defaults_match_the_published_means() -> None:
    """Mooncake FAST'25's released trace: average input 7,590 tokens, output 182 (docstring)."""
    trace = generate(Generator.SESSIONS, GeneratorOptions(num_requests=2000, seed=1))
    assert 6000 < statistics.mean(prompts(trace)) < 9500
    assert 160 < statistics.mean(r.output_tokens for r in trace) < 205
    starts = [r.arrival_ms for r in trace if r.parent is None]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 1.1  # bursty: Gamma shape 0.5 has CV 1.41


def test_shape_knobs() -> None:
    one = sessions(50, seed=0, gap_ms=10.0, mean_output_tokens=8.0,
                   shape=SessionShape(max_turns=1, document_probability=0.0, system_prompts=1))
    assert all(r.parent is None and len(r.turn_ends) == 1 for r in one)
    assert len({r.new_tokens[: r.turn_ends[0]] for r in one}) == 1
