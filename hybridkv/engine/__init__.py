"""The reference engine (torch, CPU): scheduler, runner, paged attention, models, sampler, `LLM`.

    LLM.generate --> Scheduler (FCFS, decode first, token budget, chunked prefill,
                      |         preemption by recompute) -- asks KVCacheManager (core) for blocks
                      v
                 ModelRunner (KV cache tensors from the planner's KVCacheConfig, block tables,
                      |       slot mapping) --> model (models/) --> paged attention
                      v
                 Sampler --> tokens appended to the requests

Modules: config (EngineConfig, torch-free), llm (LLM, outputs), engine_core (the incremental
API's bookkeeping: add_request / step / abort), scheduler, request, runner,
attention (metadata + paged attention), sampler, loader (HF dirs), tokenizer, host_memory
(free-memory check), default_model (the embedded tiny Gemma 3), workload (`hybridkv run`
workloads, torch-free), models/ (one file per architecture; base.py holds the model contract).
Importing this package pulls in no torch.
"""
