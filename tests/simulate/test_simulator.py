"""`hybridkv simulate`'s loop, ideal and hit-limit counts on traces small enough to work out by hand."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.errors import ConfigError
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate
from hybridkv.simulate.ideal import IdealCache
from hybridkv.simulate.simulator import SimOptions, simulate
from hybridkv.simulate.trace import TraceRequest
from tests.factories import make_config, make_group

OPTIONS = SimOptions(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)


def limits(report: object, group: int = 0) -> dict[str, int]:
    counts = report.groups[group].limited_by  # type: ignore[attr-defined]
    return {k: v for k, v in counts.items() if v}


def test_a_turn_hits_its_parents_full_blocks_and_the_ideal_is_what_the_parent_computed() -> None:
    # A: 40 prompt tokens, 4 generated (the 4th never computed): 43 computed tokens, 2 full blocks of 16.
    # B extends A's whole sequence (44 tokens) with 10: ideal 43, hit 32 (block 2 was partial in A).
    trace = [TraceRequest(arrival_ms=0, new_tokens=tuple(range(1, 41)), output_tokens=4),
             TraceRequest(arrival_ms=0, new_tokens=tuple(range(100, 110)), output_tokens=1, parent=0)]
    report = simulate(trace, make_config(num_blocks=64), OPTIONS)
    assert (report.prompt_tokens, report.ideal_tokens, report.hit_tokens) == (40 + 54, 43, 32)
    assert report.generated_tokens == 4 + 1 and report.preemptions == 0
    assert report.prefill_tokens == 40 + 54 - 32  # every prompt token but B's hit is computed once
    # A found nothing cached at 16 tokens; B's next block (tokens 32..47) was never cached (partial in A)
    assert limits(report) == {"never_cached": 2}


def test_a_repeated_prompt_is_limited_by_the_block_floor() -> None:
    prompt = tuple(range(1, 21))  # 20 tokens: hits stop at 16, the next block would end at 32 > 19
    trace = [TraceRequest(arrival_ms=0, new_tokens=prompt, output_tokens=1),
             TraceRequest(arrival_ms=1000, new_tokens=prompt, output_tokens=1)]
    report = simulate(trace, make_config(num_blocks=64), OPTIONS)
    assert (report.ideal_tokens, report.hit_tokens) == (19, 16)
    assert limits(report) == {"never_cached": 1, "block_floor": 1}


def test_an_evicted_prefix_counts_as_evicted() -> None:
    # 4 usable blocks: A caches 2, B (60 tokens) takes all 4, so C = A's prompt finds them evicted.
    a = tuple(range(1, 33))
    trace = [TraceRequest(arrival_ms=0, new_tokens=a, output_tokens=1),
             TraceRequest(arrival_ms=1000, new_tokens=tuple(range(1000, 1060)), output_tokens=1),
             TraceRequest(arrival_ms=2000, new_tokens=a, output_tokens=1)]
    report = simulate(trace, make_config(num_blocks=5), OPTIONS)
    assert (report.ideal_tokens, report.hit_tokens) == (31, 0)
    assert limits(report) == {"never_cached": 2, "evicted": 1}


def test_a_state_group_without_a_checkpoint_there_is_the_limit() -> None:
    # full + Mamba (align): A's one-step prefill of 64 tokens checkpoints the state at 64 only; C shares
    # A's first 40 tokens: full holds blocks 0-1, the state group has no checkpoint at 16 or 32.
    groups = [make_group(kind="full"), make_group(kind="mamba")]
    a = tuple(range(1, 65))
    trace = [TraceRequest(arrival_ms=0, new_tokens=a, output_tokens=1),
             TraceRequest(arrival_ms=1000, new_tokens=a[:40] + (999,) * 9, output_tokens=1)]
    report = simulate(trace, make_config(groups=groups, num_blocks=64), OPTIONS)
    assert (report.ideal_tokens, report.hit_tokens) == (40, 0)
    assert limits(report, 1) == {"never_cached": 1, "missing_checkpoint": 1}
    assert limits(report, 0) == {"never_cached": 1}


def test_the_ideal_equals_a_brute_force_longest_common_prefix() -> None:
    rng = random.Random(0)
    cache, seen = IdealCache(), []
    for _ in range(300):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(1, 20))]
        brute = max((next((i for i, (x, y) in enumerate(zip(seq, s, strict=False)) if x != y), min(len(seq), len(s)))
                     for s in seen), default=0)
        assert cache.longest_prefix(seq) == brute
        cache.add(seq)
        seen.append(seq)


@pytest.mark.parametrize("kind", list(Generator))
def test_generators_are_seeded_and_name_only_earlier_parents(kind: Generator) -> None:
    options = GeneratorOptions(num_requests=60, seed=3)
    trace = generate(kind, options)
    assert trace == generate(kind, options) and trace != generate(kind, GeneratorOptions(num_requests=60, seed=4))
    assert len(trace) == 60
    assert all(r.parent is None or 0 <= r.parent < i for i, r in enumerate(trace))
    assert [r.arrival_ms for r in trace] == sorted(r.arrival_ms for r in trace)


def test_every_generated_trace_hits_and_never_beats_the_ideal() -> None:
    config = make_config(groups=[make_group(kind="full"), make_group(kind="sliding_window", window_tokens=64)],
                         num_blocks=4000)
    for kind in Generator:
        trace = generate(kind, GeneratorOptions(num_requests=40, mean_prompt_tokens=256, mean_output_tokens=16))
        report = simulate(trace, config, SimOptions(max_model_len=8192))
        assert 0 < report.hit_tokens <= report.ideal_tokens < report.prompt_tokens, kind


def test_a_parent_that_comes_later_is_refused() -> None:
    trace = [TraceRequest(arrival_ms=0, new_tokens=(1,), output_tokens=1, parent=1),
             TraceRequest(arrival_ms=0, new_tokens=(2,), output_tokens=1)]
    with pytest.raises(ConfigError, match="parent 1"):
        simulate(trace, make_config(), OPTIONS)


def test_simulate_imports_no_torch() -> None:
    code = "import sys, hybridkv.simulate.simulator, hybridkv.cli.simulate; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_cli_json_on_a_catalog_model() -> None:
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--generate", "system-prompt", "--num-requests",
                                      "30", "--memory-gib", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["requests"] == 30 and 0 < out["hit_tokens"] <= out["ideal_tokens"]
    assert [g["kind"] for g in out["groups"]].count("full") == 1 and len(out["groups"]) == 7


def test_cli_needs_exactly_one_trace_source() -> None:
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it"])
    assert result.exit_code == 2 and "exactly one of --trace" in result.output


def test_a_junction_checkpoint_lets_a_sibling_resume_at_the_shared_prefix() -> None:
    # full + Mamba (align, blocks of 16). A (64 tokens) checkpoints at 48 and 64. B shares A's first 40 tokens:
    # full attention holds 32 of them, the state group nothing at or below 32, so B hits 0 and its junction
    # (shared_prefix_boundary) is 32: B's first chunk stops there and checkpoints the state. C, another
    # sibling of the same 40 tokens, then resumes at 32.
    groups = [make_group(kind="full"), make_group(kind="mamba")]
    a = tuple(range(1, 65))
    trace = [TraceRequest(arrival_ms=0, new_tokens=a, output_tokens=1),
             TraceRequest(arrival_ms=1000, new_tokens=a[:40] + (900,) * 9, output_tokens=1),
             TraceRequest(arrival_ms=2000, new_tokens=a[:40] + (901,) * 9, output_tokens=1)]
    report = simulate(trace, make_config(groups=groups, num_blocks=64), OPTIONS)
    assert report.request_hits == (0, 0, 32)
    assert report.request_ideals == (0, 40, 40) and report.ideal_tokens == 40 + 40


def test_turn_checkpoints_let_the_second_sharer_of_a_system_prompt_resume() -> None:
    # full + Mamba (align, blocks of 16). A = a 40-token system prompt + 9 question tokens, in one chunk:
    # its state is checkpointed at 48 only. B, the second request with that system prompt, hits 0 (no
    # checkpoint at or below 40) unless A's message end (40, block-floored: 32) was a checkpoint stop.
    import dataclasses

    groups = [make_group(kind="full"), make_group(kind="mamba")]
    system = tuple(range(1, 41))
    trace = [TraceRequest(arrival_ms=0, new_tokens=system + (900,) * 9, output_tokens=1, turn_ends=(40,)),
             TraceRequest(arrival_ms=1000, new_tokens=system + (901,) * 9, output_tokens=1, turn_ends=(40,))]
    config = make_config(groups=groups, num_blocks=64)
    assert simulate(trace, config, OPTIONS).request_hits == (0, 0)
    hinted = dataclasses.replace(OPTIONS, cache=OPTIONS.cache.replace(turn_checkpoints=True))
    assert simulate(trace, config, hinted).request_hits == (0, 32)


def test_generated_turn_ends_are_the_shared_system_prompts() -> None:
    # two first turns share exactly their tokens before the turn end when the ends are equal (the same
    # system prompt / tool spec, then a fresh question), and less than either end otherwise
    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    for kind, most in ((Generator.SYSTEM_PROMPT, 8), (Generator.AGENTIC, 1)):
        firsts = [r for r in generate(kind, GeneratorOptions(num_requests=60, seed=3)) if r.parent is None]
        assert all(len(r.turn_ends) == 1 for r in firsts)
        assert 1 < len({r.turn_ends for r in firsts} | {()}) <= most + 1
        for i, a in enumerate(firsts):
            for b in firsts[i + 1 :]:
                shared = common(a.new_tokens, b.new_tokens)
                if a.turn_ends == b.turn_ends:
                    assert shared == a.turn_ends[0]
                else:
                    assert shared < min(a.turn_ends[0], b.turn_ends[0])


def test_turn_ends_outside_the_new_tokens_are_refused() -> None:
    with pytest.raises(ConfigError, match="turn_ends must be increasing positions inside the 3 new tokens"):
        TraceRequest(arrival_ms=0, new_tokens=(1, 2, 3), output_tokens=1, turn_ends=(3,))
    with pytest.raises(ConfigError, match="got \\(2, 1\\)"):
        TraceRequest(arrival_ms=0, new_tokens=(1, 2, 3), output_tokens=1, turn_ends=(2, 1))


@pytest.mark.slow
def test_simulate_runs_on_every_catalog_model() -> None:
    from hybridkv.catalog import catalog
    from hybridkv.cli.plan_report import PlanRequest, make_plan

    trace = generate(Generator.CHAT, GeneratorOptions(num_requests=20, mean_prompt_tokens=512, mean_output_tokens=16))
    for entry in catalog():
        _, plan = make_plan(PlanRequest(model=entry.hf_id, memory_gib=16, max_model_len=8192))
        report = simulate(trace, plan.config, SimOptions(max_model_len=plan.options.max_model_len))
        assert report.requests == 20 and report.hit_tokens <= report.ideal_tokens, entry.hf_id
        if entry.hf_id == "nvidia/NVIDIA-Nemotron-Nano-9B-v2":  # unified blocks longer than these prompts
            limits = report.groups[0].limited_by
            assert report.hit_tokens == 0 and max(limits, key=limits.__getitem__) == "block_floor", limits


@pytest.mark.slow
def test_cli_plot_writes_hit_rate_against_memory(tmp_path: Path) -> None:
    picture = tmp_path / "hits.png"
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--generate", "chat", "--num-requests", "30",
                                      "--memory-gib", "1", "--plot", str(picture), "--json"])
    assert result.exit_code == 0, result.output
    curve = json.loads(result.output)["memory_curve"]
    assert [point["memory_gib"] for point in curve] == [0.125, 0.25, 0.5, 1.0, 2.0, 4.0]
    rates = [point["hit_rate"] for point in curve]
    fits = [rate for rate in rates if rate is not None]  # (the smallest budgets cannot hold one request)
    assert rates[len(rates) - len(fits):] == fits and len(fits) >= 3
    assert fits == sorted(fits) and fits[-1] > fits[0]  # more memory never lost hits here
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("order", ["fcfs", "cache_aware"])
def test_cli_queue_order_reports_prefill_and_waits(order: str) -> None:
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--generate", "system-prompt", "--num-requests",
                                      "30", "--memory-gib", "1", "--queue-order", order, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    # every prompt token is either a hit or computed (recompute after a preemption adds to the latter)
    recomputed = out["prefill_tokens"] - (out["prompt_tokens"] - out["hit_tokens"])
    assert recomputed >= 0 and (out["preemptions"] > 0 or recomputed == 0)
    assert out["p95_wait_ms"] % 30 == 0 and out["p95_wait_ms"] >= 0  # whole steps of 30 ms
    assert out["mean_wait_ms"] >= 0


def test_a_step_takes_longer_for_each_token_it_computes() -> None:
    # one request at a time, 64 tokens per step, 30 ms a step plus 1 ms per computed token. A (100
    # tokens, 1 output) arrives at 0: its steps compute 64 then 36 tokens and end at 94 and 160 ms. B
    # (10 tokens) arrives at 50 ms, joins the queue at 94 (the first step's end) and runs at 160:
    # a 66 ms wait. With steps of 30 ms whatever they compute, A is done at 60 before B arrives.
    import dataclasses

    trace = [TraceRequest(arrival_ms=0, new_tokens=tuple(range(1, 101)), output_tokens=1),
             TraceRequest(arrival_ms=50, new_tokens=tuple(range(500, 510)), output_tokens=1)]
    options = SimOptions(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=1)
    config = make_config(num_blocks=64)
    assert simulate(trace, config, options).mean_wait_ms == 0
    timed = simulate(trace, config, dataclasses.replace(options, ms_per_token=1.0))
    assert timed.mean_wait_ms == 66 / 2
    with pytest.raises(ConfigError, match="ms_per_token must be >= 0"):
        dataclasses.replace(options, ms_per_token=-1.0)


def test_a_preempted_request_waits_again_until_it_runs_again() -> None:
    # 4 usable blocks of 16, 30 ms steps. A (32 tokens, 20 outputs) and B (16 tokens) both start at 0 ms
    # (2 + 1 blocks). At 30 ms A's decode needs its 3rd block (the last free one) and B its 2nd: none
    # left, so B (the later arrival) is preempted. A decodes alone (its 4th block comes from B's) and
    # ends in the step at 570 ms; B runs again at 600 ms: it waited 0 + 570 ms.
    trace = [TraceRequest(arrival_ms=0, new_tokens=tuple(range(1, 33)), output_tokens=20),
             TraceRequest(arrival_ms=0, new_tokens=tuple(range(100, 116)), output_tokens=20)]
    options = SimOptions(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=2)
    report = simulate(trace, make_config(num_blocks=5), options)
    assert report.preemptions == 1
    assert (report.mean_wait_ms, report.p95_wait_ms) == (570 / 2, 570)


def test_progress_counts_finished_requests_up_to_the_trace() -> None:
    """The callback sees (finished, 60) never decreasing, and (60, 60) last; the report is the same without it."""
    config, options = make_config(num_blocks=2048), SimOptions(max_model_len=8192)
    trace = generate(Generator.CHAT, GeneratorOptions(num_requests=60, seed=3))
    calls: list[tuple[int, int]] = []
    with_progress = simulate(trace, config, options, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (60, 60) and len(calls) > 2
    assert all(total == 60 for _, total in calls)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    without = simulate(trace, config, options)
    assert (with_progress.request_hits, with_progress.steps) == (without.request_hits, without.steps)


def test_cli_progress_goes_to_stderr_and_json_stays_whole() -> None:
    """`--progress` where stderr is no terminal: a line per tenth of the trace on stderr, stdout one JSON document."""
    args = [sys.executable, "-m", "hybridkv", "simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "40",
            "--memory-gib", "0.4", "--json"]
    shown = subprocess.run([*args, "--progress"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["requests"] == 40
    lines = [line for line in shown.stderr.splitlines() if "requests finished" in line]
    assert lines[-1].startswith("simulate 0.4 GiB: 40/40 requests finished") and len(lines) >= 5, shown.stderr
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=120)  # (not a terminal: off by default)
    assert "requests finished" not in quiet.stderr and json.loads(quiet.stdout) == json.loads(shown.stdout) | {
        "wall_s": json.loads(quiet.stdout)["wall_s"]}
