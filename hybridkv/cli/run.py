"""`hybridkv run`: the reference engine on a chat workload, with a report of its KV cache use.

Registered in `hybridkv/cli/__init__.py` as `app.command("run")(run.run_command)`. torch is
imported only when the command runs, so `hybridkv plan` stays light. Without `--workload` it
runs the built-in multi-turn chat (six sessions sharing a system prompt, three turns each, every
turn extending the previous one); `--workload FILE.jsonl` runs a file in the format documented
in `hybridkv/scheduling/workload.py`.

The report: requests, prompt/generated tokens, throughput, mean TTFT, prefix-cache hit rate per
KV cache group, and the KV memory the hybrid layout used against what the uniform layout (every
layer cached as full attention) would have needed for the same tokens.

`--kv-server URL|auto` attaches the KV cache server (auto: one started for the run); `--passes N`
runs the workload N times, clearing only the engine's local prefix cache in between, so later
passes are served by the server, and says whether every pass generated the same tokens;
`--reset-prefix-cache-between-rounds` also clears it between rounds. `--json` adds per request
the generated `token_ids`, `local_hit_tokens`, `external_hit_tokens`, `computed_prefill_tokens`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hybridkv.cli import engine_options as opt
from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.cli.tables import layer_list, new_table, print_table, stdout_console
from hybridkv.engine.config import DEFAULT_MODEL_NAME, EngineConfig
from hybridkv.errors import HybridKVError
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.kvcache.options import describe
from hybridkv.scheduling.workload import Conversation, Turn, builtin_chat, load_jsonl, rounds

if TYPE_CHECKING:
    from hybridkv.engine.llm import LLM

MIB = 1024**2
# Option names as the engine's errors spell them -> the flags a user typed.
RUN_FLAGS = flags_of([*EngineConfig.option_names(), "max_tokens", "temperature"], num_threads="--threads")


@opt.with_engine_options
def run_command(
    model: opt.Model = DEFAULT_MODEL_NAME,
    workload: Annotated[Path | None, typer.Option(
        "--workload", help="JSONL: one {prompt | prompt_token_ids, session?, max_tokens?} per line")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    max_tokens: Annotated[int, typer.Option(help="tokens generated per request (unless the workload says)")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    passes: Annotated[int, typer.Option(help="run the workload this many times, clearing only the engine's local "
                                             "prefix cache in between")] = 1,
    reset_prefix_cache_between_rounds: Annotated[bool, typer.Option(
        "--reset-prefix-cache-between-rounds", help="also clear the local prefix cache between workload rounds")]
    = False,
    cache_salt: Annotated[str | None, typer.Option(
        "--cache-salt", help="cache salt of requests whose workload line names none (tenants never share "
                             "blocks)")] = None,
    *,
    engine: EngineConfig,
) -> None:
    """Run the reference engine on a chat workload; report KV cache use.

    Without --workload: the built-in multi-turn chat on the embedded default model. The report
    gives throughput, TTFT, prefix-cache hits and the KV memory the hybrid layout used.
    """
    # Idle OpenMP threads sleep instead of spinning: on a small machine shared with other work,
    # spinning threads that lose their core stall every parallel region. Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    err = Console(stderr=True)
    try:
        config = engine
        if passes < 1:
            raise usage_error(f"--passes must be at least 1, got {passes}")
        if cache_salt == "":
            raise usage_error("--cache-salt must be a non-empty string")
        turns = load_jsonl(workload) if workload is not None else builtin_chat()
        from hybridkv.engine.llm import LLM
        from hybridkv.engine.sampler import SamplingParams

        base = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        load_start = time.perf_counter()
        llm = LLM(model, **opt.engine_kwargs(config))
        load_s = time.perf_counter() - load_start
        with llm:
            _note_tokenizer(llm, model, err)
            runs = [_run_rounds(llm, turns, base, err, pass_index=p, default_salt=cache_salt,
                                reset_between_rounds=reset_prefix_cache_between_rounds) for p in range(passes)]
            report = _combine(runs)
            report.update(_memory_report(llm, report))
            if llm.transfer is not None:
                report["kv_server"] = _server_report(llm)
    except HybridKVError as exc:
        raise usage_error(str(exc), RUN_FLAGS) from None
    report["model"] = model
    report["load_s"] = round(load_s, 3)
    report["config"] = {k: (v.value if isinstance(v, Enum) else v)
                        for k, v in _asdict(config).items()}
    report["config"]["max_model_len"] = llm.max_model_len
    report["config"]["cache"] = describe(config.cache)
    if model == DEFAULT_MODEL_NAME:
        from hybridkv.engine.default_model import MEANINGLESS_NOTE

        report["note"] = MEANINGLESS_NOTE
    if json_output:
        print(json.dumps(report, indent=2))
    else:
        _render(stdout_console(), report)


def _asdict(config: EngineConfig) -> dict[str, Any]:
    own = {name: getattr(config, name) for name in EngineConfig.option_names()}
    return {**own, **{f.name: getattr(config.cache, f.name) for f in dataclasses.fields(config.cache)}}


def _run_rounds(llm: LLM, turns: list[Turn], base: Any, err: Console, *, pass_index: int,
                default_salt: str | None, reset_between_rounds: bool) -> dict[str, Any]:
    """Run every round of the workload once (pass `pass_index`: the local prefix cache is cleared
    before every pass but the first); returns that pass's part of the report."""
    import dataclasses

    if pass_index:
        llm.reset_prefix_cache()
    conversation = Conversation(llm.tokenizer.encode, llm.tokenizer.encode_continuation)
    columns = (TextColumn(f"[bold]pass {pass_index + 1} requests"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    capped: list[str] = []
    per_request: list[dict[str, Any]] = []
    start = time.perf_counter()
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("requests", total=len(turns))
        for k, batch in enumerate(rounds(turns)):
            if k and reset_between_rounds:
                llm.reset_prefix_cache()
            prompts = [llm.check_prompt(conversation.prompt(turn), label=turn.label, length_option="--max-model-len")
                       for turn in batch]
            params = [dataclasses.replace(base, max_tokens=t.max_tokens or base.max_tokens) for t in batch]
            capped += [f"{t.label}: {len(p)} prompt + {s.max_tokens} max_tokens" for t, p, s
                       in zip(batch, prompts, params, strict=True) if len(p) + s.max_tokens > llm.max_model_len]
            outputs = llm.generate(prompts, params, on_finish=lambda _: progress.advance(task),
                                   cache_salt=[t.cache_salt or default_salt for t in batch])
            for turn, prompt, output in zip(batch, prompts, outputs, strict=True):
                conversation.record(turn, prompt, output.token_ids)
                m = output.metrics
                per_request.append({
                    "pass": pass_index + 1, "label": turn.label, "session": turn.session,
                    "prompt_tokens": len(prompt), "token_ids": list(output.token_ids),
                    "local_hit_tokens": m.local_hit_tokens, "external_hit_tokens": m.external_hit_tokens,
                    "computed_prefill_tokens": m.computed_prefill_tokens, "ttft_s": round(m.ttft_s, 4)})
    elapsed = time.perf_counter() - start
    if capped and not pass_index:
        err.print(f"[yellow]note:[/] {len(capped)} request(s) asked for more tokens than --max-model-len "
                  f"{llm.max_model_len} holds, so generation stopped at that length (first: {capped[0]})",
                  highlight=False, soft_wrap=True)
    return {"elapsed_s": elapsed, "rounds": len(rounds(turns)), "per_request": per_request, "capped": len(capped),
            "steps": llm.stats.steps, "preemptions": llm.stats.preemptions}


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "generated_tokens": sum(len(r["token_ids"]) for r in rows),
            **{k: sum(r[k] for r in rows) for k in ("local_hit_tokens", "external_hit_tokens",
                                                     "computed_prefill_tokens")}}


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The request-level report over every pass: totals, one summary per pass, every request."""
    rows = [r for run in runs for r in run["per_request"]]
    totals = _totals(rows)
    elapsed = sum(run["elapsed_s"] for run in runs)
    ttfts = [r["ttft_s"] for r in rows]
    passes = [{"pass": i + 1, **_totals(run["per_request"]), "elapsed_s": round(run["elapsed_s"], 3),
               "mean_ttft_s": round(sum(r["ttft_s"] for r in run["per_request"]) / len(run["per_request"]), 4)}
              for i, run in enumerate(runs)]
    first = [r["token_ids"] for r in runs[0]["per_request"]]
    return {
        "requests": totals["requests"], "rounds": runs[0]["rounds"], "passes": passes,
        "prompt_tokens": totals["prompt_tokens"], "prompt_hit_tokens": totals["local_hit_tokens"],
        "generated_tokens": totals["generated_tokens"], "elapsed_s": round(elapsed, 3),
        "generated_tok_per_s": round(totals["generated_tokens"] / elapsed, 1),
        "total_tok_per_s": round((totals["prompt_tokens"] + totals["generated_tokens"]) / elapsed, 1),
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4), "max_ttft_s": round(max(ttfts), 4),
        "steps": runs[-1]["steps"], "preemptions": runs[-1]["preemptions"],
        "max_tokens_capped_requests": runs[0]["capped"],
        "outputs_identical_across_passes": (all([r["token_ids"] for r in run["per_request"]] == first
                                                for run in runs[1:]) if len(runs) > 1 else None),
        "totals": totals, "per_request": rows,
    }


def _server_report(llm: LLM) -> dict[str, Any]:
    """What moved between the engine and the KV cache server, per object group."""
    assert llm.transfer is not None
    connector = llm.transfer.connector
    stats = connector.stats
    return {
        "url": llm.config.kv_server if llm.transfer.server is None else llm.transfer.server.endpoint,
        "started_for_this_run": llm.transfer.server is not None, "chunk_tokens": connector.chunk_tokens,
        "reachable": connector.reachable,
        "object_groups": [{"name": name, "stored_bytes": stats.saved_bytes_by_group.get(name, 0),
                           "retrieved_bytes": stats.loaded_bytes_by_group.get(name, 0)}
                          for name in connector.object_groups],
        "lookups": stats.lookups, "external_hit_tokens": stats.external_hit_tokens, "loads": stats.loads,
        "failed_loads": stats.failed_loads, "stored_chunks": stats.saved_chunks,
        "refused_chunks": stats.refused_chunks, "failed_stores": stats.failed_saves, "errors": stats.errors,
    }


def _note_tokenizer(llm: LLM, model: str, err: Console) -> None:
    """Say once on stderr when a real model's directory has no tokenizer.json (text -> UTF-8 bytes)."""
    from hybridkv.engine.tokenizer import ByteTokenizer

    if model != DEFAULT_MODEL_NAME and isinstance(llm.tokenizer, ByteTokenizer):
        err.print(f"[yellow]note:[/] {llm.model_dir} has no tokenizer.json: text prompts use the byte-level "
                  "tokenizer (id = UTF-8 byte + 3), which is not the model's own", highlight=False, soft_wrap=True)


def _memory_report(llm: LLM, requests: dict[str, Any]) -> dict[str, Any]:
    """Prefix-cache hits (per request, then recomputation) and KV memory: layout and sharing savings."""
    stats, plan, engine = llm.manager_stats(), llm.plan, llm.stats
    groups = [{
        "group_id": g.group_id, "kind": g.kind.value, "layers": list(g.layer_indices), "block_size": g.block_size,
        "window_tokens": g.window_tokens or None, "chunk_tokens": g.chunk_tokens or None,
        "hit_rate": round(hits / stats.query_tokens, 4) if stats.query_tokens else 0.0,
        "peak_blocks": peak, "hit_limited_by": {limit.value: n for limit, n in limits.items()},
    } for g, hits, peak, limits in zip(plan.config.groups, stats.group_hit_tokens, engine.peak_group_blocks,
                                       stats.limited_by, strict=True)]
    used, unshared, uniform = engine.peak_kv_bytes, engine.peak_unshared_kv_bytes, engine.peak_uniform_kv_bytes
    prompt_tokens, prompt_hits = requests["prompt_tokens"], requests["prompt_hit_tokens"]
    ratio = plan.capacity_ratio
    return {
        "prefix_cache": {
            "enabled": llm.config.cache.prefix_caching is PrefixCaching.ON,
            "prompt_tokens": prompt_tokens, "hit_tokens": prompt_hits,
            "hit_rate": round(prompt_hits / prompt_tokens, 4) if prompt_tokens else 0.0,
            "repeated_lookups": {  # a request looked up again: still waiting for room, or preempted
                "preemptions": engine.preemptions, "lookups": stats.lookups - requests["requests"],
                "query_tokens": stats.query_tokens - prompt_tokens, "hit_tokens": stats.hit_tokens - prompt_hits,
            },
            "groups": groups,
        },
        "kv_memory": {
            "allocated_bytes": llm.kv_cache_bytes, "planned_bytes": plan.config.total_bytes,
            "peak_used_bytes": used, "peak_unshared_bytes": unshared,
            "uniform_layout_bytes_for_same_tokens": uniform,
            "layout_saving": round(1 - unshared / uniform, 4) if uniform else 0.0,
            "prefix_sharing_saving": round(1 - used / unshared, 4) if unshared else 0.0,
            "max_concurrency": round(plan.max_concurrency, 4),
            "uniform_max_concurrency": round(plan.uniform.max_concurrency, 4),
            "capacity_ratio": None if math.isinf(ratio) else round(ratio, 4),
        },
    }


def _render_passes(console: Console, report: dict[str, Any]) -> None:
    """Per pass the local and external hits; per object group the bytes moved; whether outputs matched."""
    passes = new_table(("pass", "right"), ("prompt tokens", "right"), ("local hits", "right"),
                       ("server hits", "right"), ("computed prefill", "right"), ("mean TTFT", "right"))
    for p in report["passes"]:
        passes.add_row(str(p["pass"]), str(p["prompt_tokens"]), str(p["local_hit_tokens"]),
                       str(p["external_hit_tokens"]), str(p["computed_prefill_tokens"]),
                       f"{p['mean_ttft_s'] * 1000:.1f} ms")
    print_table(console, passes, title="passes (the local prefix cache is cleared before each pass after the first)")
    server = report.get("kv_server")
    if server is not None:
        moved = new_table("object group", ("stored", "right"), ("retrieved", "right"))
        for og in server["object_groups"]:
            moved.add_row(og["name"], f"{og['stored_bytes'] / MIB:.2f} MiB", f"{og['retrieved_bytes'] / MIB:.2f} MiB")
        origin = ("unreachable" if not server["reachable"] else
                  "started for this run" if server["started_for_this_run"] else "attached")
        print_table(console, moved, title=f"KV cache server {server['url']} ({origin}, chunk {server['chunk_tokens']} "
                                          "tokens)",
                    caption=f"{server['stored_chunks']} chunks stored, {server['loads']} loads, "
                            f"{server['failed_loads']} failed loads, {server['errors']} errors")
    same = report["outputs_identical_across_passes"]
    if same is not None:
        console.print(f"outputs identical across {len(report['passes'])} passes: "
                      f"{'yes' if same else '[red]NO[/]'}", highlight=False)


def _requests_text(report: dict[str, Any]) -> str:
    """`18 per pass x 2 passes = 36`, or `18` for one pass."""
    passes = len(report["passes"])
    if passes == 1:
        return str(report["requests"])
    return f"{report['requests'] // passes} per pass x {passes} passes = {report['requests']}"


def _summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows: every figure says what it counts."""
    kv, cache = report["kv_memory"], report["prefix_cache"]
    again, totals = cache["repeated_lookups"], report["totals"]
    return [
        ("requests", _requests_text(report)),
        ("rounds per pass", f"{report['rounds']} (one per turn)"),
        ("prompt / generated tokens", f"{report['prompt_tokens']} / {report['generated_tokens']}"),
        ("throughput", f"{report['generated_tok_per_s']:.1f} generated tok/s ({report['total_tok_per_s']:.1f} total)"),
        ("mean TTFT", f"{report['mean_ttft_s'] * 1000:.1f} ms (max {report['max_ttft_s'] * 1000:.1f} ms)"),
        ("steps / preemptions", f"{report['steps']} / {report['preemptions']}"),
        ("prefix-cache hit rate", f"{cache['hit_rate']:.1%} ({cache['hit_tokens']} of {cache['prompt_tokens']} "
                                  "prompt tokens)"),
        *([("KV cache server hits", f"{totals['external_hit_tokens']} prompt tokens loaded"),
           ("prompt tokens computed", f"{totals['computed_prefill_tokens']} (in neither cache)")]
          if "kv_server" in report else []),
        *([("lookups repeated (see below)", f"{again['lookups']} lookups of {again['query_tokens']} tokens, "
                                            f"{again['hit_tokens']} hit")] if again["lookups"] else []),
        ("KV memory allocated", f"{kv['allocated_bytes'] / MIB:.2f} MiB (as planned: {kv['planned_bytes'] / MIB:.2f})"),
        ("KV memory peak used (hybrid)", f"{kv['peak_used_bytes'] / MIB:.2f} MiB"),
        ("same, without prefix sharing", f"{kv['peak_unshared_bytes'] / MIB:.2f} MiB "
                                         f"(prefix sharing saves {kv['prefix_sharing_saving']:.1%})"),
        ("same tokens, uniform layout", f"{kv['uniform_layout_bytes_for_same_tokens'] / MIB:.2f} MiB "
                                        f"(hybrid layout saves {kv['layout_saving']:.1%})"),
        (f"max concurrency at {report['config']['max_model_len']} tokens",
         f"hybrid {kv['max_concurrency']:.2f} / uniform {kv['uniform_max_concurrency']:.2f}"),
    ]


def _render(console: Console, report: dict[str, Any]) -> None:
    cache = report["prefix_cache"]
    table = new_table("metric", ("value", "right"), show_header=False)
    rows = _summary_rows(report)
    for name, value in rows:
        table.add_row(name, value)
    notes = ["rounds: a session's next turn is sent once the answer to its previous turn is in"]
    if cache["repeated_lookups"]["lookups"]:
        notes.append("lookups repeated: a request that waited for KV cache room, or was preempted, is looked up "
                     "again when it is scheduled; those lookups are not in the hit rate")
    print_table(console, table, title=f"hybridkv run: {report['model']}", caption="; ".join(notes) + ".")
    groups = new_table(("group", "right"), "kind", "layers", ("block", "right"), ("window", "right"),
                       ("hit rate", "right"), ("peak blocks", "right"), "hit limited by")
    for g in cache["groups"]:
        kind = g["kind"].removesuffix("_window").removesuffix("_local")
        groups.add_row(str(g["group_id"]), kind, layer_list([str(i) for i in g["layers"]]), str(g["block_size"]),
                       str(g["window_tokens"] or g["chunk_tokens"] or "-"), f"{g['hit_rate']:.1%}",
                       str(g["peak_blocks"]), ", ".join(f"{k} {n}" for k, n in g["hit_limited_by"].items() if n) or "-")
    print_table(console, groups, title="KV cache groups",
                caption="hit rate: tokens this group alone could serve, over every lookup (recomputation included)")
    if len(report["passes"]) > 1 or "kv_server" in report:
        _render_passes(console, report)
    if report.get("note"):
        console.print(f"[yellow]note:[/] {report['note']}", highlight=False)
