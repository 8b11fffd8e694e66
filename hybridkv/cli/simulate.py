"""`hybridkv simulate MODEL --trace FILE`: the KV cache manager alone on a trace (no engine, no torch).

MODEL is planned as `hybridkv plan` plans it (same layout options); the trace runs through the
engine's scheduler over a fresh manager (`hybridkv/simulate/`). Prints hit tokens against an
infinite-cache ideal, why each group stopped hits, preemptions and concurrency; `--json` the
same as JSON; `--plot FILE` the hit rate against the memory budget (the run repeated at 1/8..4x).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridkv.cli.cache_flags import with_cache_options
from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.cli.plan_report import PlanRequest
from hybridkv.cli.sim_progress import RunBars, Update, run_bars
from hybridkv.cli.tables import stdout_console
from hybridkv.errors import CapacityError, ConfigError, HybridKVError
from hybridkv.kvcache.options import PRESETS, CacheOptions
from hybridkv.plan.kv_cache_config import KVCacheConfig
from hybridkv.plan.model_specs import KVCacheDType, SpecOptions
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate
from hybridkv.simulate.simulator import SimOptions, SimReport, simulate
from hybridkv.simulate.trace import TraceFormat, TraceRequest, length_cuts, read_trace, write_mooncake

SIM_FLAGS = flags_of(["max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size", "mamba_alignment",
                      "prefix_match_unit", "step_ms", "ms_per_token", "num_requests"])
PLOT_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
@with_cache_options
def simulate_command(
    model: Annotated[str, typer.Argument(help="catalog name, config.json or model directory")],
    trace: Annotated[Path | None, typer.Option("--trace", help="JSONL workload or Mooncake trace")] = None,
    trace_format: Annotated[TraceFormat, typer.Option("--trace-format", help="auto: by hash_ids")] = TraceFormat.AUTO,
    trace_block_tokens: Annotated[int, typer.Option(
        "--trace-block-tokens", help="tokens per Mooncake hash_id block")] = 512,
    generator: Annotated[Generator | None, typer.Option(
        "--generate", help="a seeded synthetic trace instead of --trace")] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", help="requests --generate makes")] = 100,
    seed: Annotated[int, typer.Option("--seed", help="seed of --generate")] = 0,
    write_trace: Annotated[Path | None, typer.Option(
        "--write-trace", help="also write the trace in the Mooncake format (--trace-block-tokens blocks)")] = None,
    memory_gib: Annotated[float, typer.Option("--memory-gib", help="KV cache memory budget in GiB")] = 16.0,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="longest request")] = 32768,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", help="step budget")] = 2048,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="most running requests")] = 256,
    kv_cache_dtype: Annotated[KVCacheDType, typer.Option("--kv-cache-dtype", help="KV dtype")] = KVCacheDType.AUTO,
    block_size: Annotated[int, typer.Option("--block-size", help="attention block size before unification")] = 16,
    mamba_alignment: Annotated[int, typer.Option("--mamba-alignment", help="kernel block alignment A")] = 16,
    step_ms: Annotated[float, typer.Option("--step-ms", help="simulated time of one scheduler step")] = 30.0,
    ms_per_token: Annotated[float, typer.Option(
        "--ms-per-token", help="simulated ms each computed token adds to its step (0: steps take --step-ms)")] = 0.0,
    json_output: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="write hit rate vs memory per preset, and this run's setting (PNG, SVG, PDF)")] = None,
    progress: Annotated[bool | None, typer.Option(
        "--progress/--no-progress", help="requests finished, on stderr [default: where stderr is a terminal]",
        show_default=False)] = None,
    *,
    cache: CacheOptions,
) -> None:
    """Replay a trace through the KV cache manager of MODEL (no engine, no torch)."""
    from hybridkv.cli.plan_report import make_plan

    if (trace is None) == (generator is None):
        raise usage_error("give exactly one of --trace FILE or --generate KIND")
    if plot is not None and plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise usage_error(f"--plot {plot}: expected a file name ending in .png, .svg or .pdf")
    try:
        requests = _trace(trace, trace_format, trace_block_tokens, generator, num_requests, seed)
        if write_trace is not None:
            write_mooncake(requests, write_trace, block_tokens=trace_block_tokens)
        request = PlanRequest(model=model, memory_gib=memory_gib, max_model_len=max_model_len,
                              max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                              mamba_alignment=mamba_alignment, spec_options=SpecOptions(kv_cache_dtype=kv_cache_dtype),
                              mamba_cache_mode=cache.mamba_cache_mode, state_layout=cache.state_layout,
                              running_state=cache.running_state)
        spec, plan = make_plan(request)
        options = SimOptions(max_model_len=plan.options.max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, step_ms=step_ms, ms_per_token=ms_per_token, cache=cache)
        with run_bars(progress) as bars:
            report = _simulate_or_explain(requests, plan.config, options, bars.bar(f"{memory_gib:g} GiB"))
            scales = PLOT_SCALES if plot else ()
            curve = [(memory_gib * s, _at_budget(requests, request, memory_gib * s, options, bars)) for s in scales]
            curves = {label: [(memory_gib * s, _at_budget(requests, request, memory_gib * s,
                                                          dataclasses.replace(options, cache=setting), bars, label))
                              for s in scales]
                      for label, setting in _plot_settings(cache).items()} if plot else {}
        cuts = length_cuts(requests, options.max_model_len)
    except HybridKVError as exc:
        raise usage_error(str(exc), SIM_FLAGS) from None
    if cuts.message() is not None:  # never silently: a cut prompt or output changes every number below
        typer.echo(cuts.message(), err=True)
    if json_output:
        out = report_json(report)
        out["model"] = spec.name
        out["length_cuts"] = dataclasses.asdict(cuts)
        if curve:
            out["memory_curve"] = [{"memory_gib": m, "hit_rate": r and r.hit_rate,
                                    "hits_vs_ideal": r and r.hits_vs_ideal, "prefill_tokens": r and r.prefill_tokens}
                                   for m, r in curve]
        print(json.dumps(out, indent=2))
    else:
        render(report, spec.name, memory_gib)
    if plot is not None:
        write_memory_plot(curves, plot, model=spec.name)


def _simulate_or_explain(requests: list[TraceRequest], config: KVCacheConfig, options: SimOptions,
                         progress: Update | None = None) -> SimReport:
    """`simulate`, or a one-line CapacityError when this machine's memory cannot hold the pool's state."""
    try:
        return simulate(requests, config, options, progress=progress)
    except MemoryError:
        raise CapacityError(
            f"a pool of {config.num_blocks} blocks x {len(config.groups)} KV cache groups cannot be simulated in "
            f"this machine's memory; expected a smaller --memory-gib (or the one_page state layout, fewer groups)"
        ) from None


def _at_budget(requests: list[TraceRequest], request: PlanRequest, memory_gib: float,
               options: SimOptions, bars: RunBars, label: str = "this run") -> SimReport | None:
    """The simulation at another memory budget; None where one request alone does not fit."""
    from hybridkv.cli.plan_report import make_plan

    cache = options.cache
    planned = dataclasses.replace(request, memory_gib=memory_gib, mamba_cache_mode=cache.mamba_cache_mode,
                                  state_layout=cache.state_layout, running_state=cache.running_state)
    try:
        return _simulate_or_explain(requests, make_plan(planned)[1].config, options,
                                    bars.bar(f"{label} at {memory_gib:g} GiB"))
    except (CapacityError, ConfigError):
        return None


def _plot_settings(cache: CacheOptions) -> dict[str, CacheOptions]:
    """The curves `--plot` draws: every preset, and this run's setting where it is none of them."""
    curves = {f"--preset {name}": setting for name, setting in PRESETS.items()}
    if cache not in PRESETS.values():
        curves["this run's flags"] = cache
    return curves


def _trace(path: Path | None, trace_format: TraceFormat, block_tokens: int, generator: Generator | None,
           num_requests: int, seed: int) -> list[TraceRequest]:
    if path is not None:
        return read_trace(path, trace_format=trace_format, block_tokens=block_tokens)
    assert generator is not None
    return generate(generator, GeneratorOptions(num_requests=num_requests, seed=seed))


def report_json(report: SimReport) -> dict[str, Any]:
    """The report as JSON: every field, plus the two ratios."""
    out = dataclasses.asdict(report)
    out["hit_rate"] = report.hit_rate
    out["hits_vs_ideal"] = report.hits_vs_ideal
    return out


def render(report: SimReport, model: str, memory_gib: float) -> None:
    from rich.table import Table

    console = stdout_console()
    summary = Table(title=f"hybridkv simulate: {model} ({memory_gib:g} GiB, {report.num_blocks} blocks)",
                    show_header=False)
    summary.add_column(no_wrap=True)
    summary.add_column(justify="right")
    rows = [
        ("requests / steps", f"{report.requests} / {report.steps}"),
        ("prompt / generated tokens", f"{report.prompt_tokens} / {report.generated_tokens}"),
        ("prefix-cache hit tokens", f"{report.hit_tokens} ({report.hit_rate:.1%} of prompt tokens)"),
        ("infinite-cache ideal", f"{report.ideal_tokens} (hits are {report.hits_vs_ideal:.1%} of it)"),
        ("preemptions", str(report.preemptions)),
        *([("block copies (before a step)", str(report.block_copies))] if report.block_copies else []),
        *([("state checkpoints copied / skipped", f"{report.checkpoint_copies} / {report.checkpoints_skipped}")]
          if report.checkpoint_copies or report.checkpoints_skipped else []),
        *([("state adoptions", str(report.state_adoptions))] if report.state_adoptions else []),
        *([("anchors hit / made, per kind", ", ".join(f"{kind} {hit} / {made}"
                                                     for kind, (made, hit) in report.anchor_reuse.items()))]
          if report.anchor_reuse else []),
        *([("online choice (ghost hits)", f"{report.online_choice}, {report.online_switches} switches ("
            + ", ".join(f"{name} {hits}" for name, hits, _ in report.online_ghosts) + ")")]
          if report.online_ghosts else []),
        ("running requests, mean / max", f"{report.mean_running:.1f} / {report.max_running}"),
        ("prompt tokens computed", f"{report.prefill_tokens} (recompute after preemption included)"),
        ("queue wait, mean / p95", f"{report.mean_wait_ms:.0f} / {report.p95_wait_ms:.0f} ms (simulated)"),
        ("lookups", str(report.lookups)),
        ("simulated in", f"{report.wall_s:.2f} s"),
    ]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    limits = Table(title="hit limited by (lookups, per group)")
    limits.add_column("group", justify="right")
    limits.add_column("kind")
    limits.add_column("block", justify="right")
    names = list(report.groups[0].limited_by) if report.groups else []
    for name in names:
        limits.add_column(name.replace("_", " "), justify="right")
    for group in report.groups:
        limits.add_row(str(group.group_id), group.kind, str(group.block_size),
                       *(str(group.limited_by[n]) for n in names))
    console.print(limits)


def write_memory_plot(curves: dict[str, list[tuple[float, SimReport | None]]], path: Path, *, model: str) -> None:
    """`memory_figure` saved to `path` (PNG, SVG or PDF)."""
    import matplotlib.pyplot as plt

    fig = memory_figure(curves, model=model)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def memory_figure(curves: dict[str, list[tuple[float, SimReport | None]]], *, model: str) -> Any:
    """Against the memory budget, per policy: the hit rate (each request's first admission; the
    infinite cache's dashed) and the prompt tokens computed per prompt token (recompute after a
    preemption included: what the memory buys; budgets where a request alone does not fit are left
    out). The first can fall where more memory admits more requests at once (a long queue lets the
    cache-aware order batch requests by cached prefix); the second is the cost. One legend below
    both panels, outside the axes, so it never covers a curve. A matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, computed) = plt.subplots(1, 2, figsize=(10, 4))
    points: list[tuple[float, SimReport]] = []
    for label, curve in curves.items():
        points = [(m, r) for m, r in curve if r is not None]
        memory = [m for m, _ in points]
        hits.plot(memory, [r.hit_rate for _, r in points], marker="o", label=label)
        computed.plot(memory, [r.prefill_tokens / max(1, r.prompt_tokens) for _, r in points], marker="o")
    memory = [m for m, _ in points]
    hits.plot(memory, [r.ideal_tokens / r.prompt_tokens if r.prompt_tokens else 0 for _, r in points], linestyle="--",
              label="infinite cache")
    computed.plot(memory, [1 - r.ideal_tokens / r.prompt_tokens if r.prompt_tokens else 0 for _, r in points],
                  linestyle="--")
    for ax, label in ((hits, "prefix-cache hit rate"), (computed, "prompt tokens computed / prompt tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV cache memory (GiB)")
        ax.set_ylabel(label)
    fig.suptitle(model)
    fig.tight_layout()
    # below the axes, outside them: inside, "best" placement still lands on a curve when the curves fill the plot
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize="small", frameon=False)
    return fig
