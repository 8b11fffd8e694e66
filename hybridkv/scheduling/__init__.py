"""Torch-free scheduling: the engine's scheduler, its queue orders and the workload files.

    scheduler.py     continuous batching over a KV cache manager: the waiting queue, the token budget
                     per step, chunked prefill, preemption, prefix hits from the manager and a connector
    queue_order.py   which waiting request is admitted next (FCFS, cache-aware)
    workload.py      the JSONL workload format `hybridkv run --workload` and `simulate --trace` read

Both the engine (which runs the model) and `hybridkv simulate` (which replays a trace through the
manager alone) drive this scheduler; neither imports the other.
"""
