"""`hybridkv simulate`: the KV cache manager alone, driven by the engine's scheduler over a trace.

No model, no torch: prompts are token ids (text is read as UTF-8 bytes), generated tokens are
synthetic, and a step takes a fixed simulated time. What it measures is what the manager decides:
prefix hits against an infinite-cache ideal, why each group stopped a hit, preemptions and
concurrency.

    trace.py       the trace: requests with arrival times, prompts (or a parent they extend), output lengths;
                   readers for our JSONL workload and the Mooncake format (and its writer)
    generators.py  seeded synthetic traces: multi-turn chat, shared system prompts, agentic tool loops, branching
    sessions.py    the production-like generator: long sessions over shared prompts and documents, bursty arrivals
    ideal.py       the infinite cache: the longest prefix already seen, at token granularity
    simulator.py   the loop: arrivals -> engine Scheduler (admission, chunked prefill, decode, preemption) -> report
"""
