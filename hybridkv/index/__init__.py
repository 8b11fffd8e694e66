"""The KV cache indexer: which engine instance holds which prefix, answered as the joint hybrid hit.

Pure Python (no torch). Routers ask it over the Mooncake Conductor Indexer HTTP API; engines feed
it vLLM's ZMQ KV event batches (vLLM itself, `hybridkv serve` / `run` with `--kv-events-config`).

    seq_hash.py     the Conductor's rolling XXH3-64 sequence hashes of token blocks
    native.py       the hash loop and the parse of a query's token ids in C (seq_chain.c, json_u32.c)
    rules.py        the joint hit of one instance from the blocks each of its groups holds (the reference)
    probe.py        the same hit from a few table probes (a query's path)
    table.py        the index: contexts (model, cache-salt namespace) -> per block, which groups hold it
    publisher.py    the manager's events as vLLM's (the wire format and the ZMQ publisher: kv_events/)
    subscriber.py   one ZMQ subscription per registered publisher: sequence numbers, replay, gaps
    service.py      registrations, ageing, the query answer
    http.py         `hybridkv index`: the HTTP routes (register, unregister, query, query_by_hash)
    http_server.py  the HTTP/1.1 server the routes run on (llhttp on an asyncio protocol)
    auth.py         the bearer token and the bind rules (loopback unless --allow-remote with a token)

docs/routing.md explains the rules and how routers (llm-d, Dynamo, `hybridkv route`) ask.
"""
