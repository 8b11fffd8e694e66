"""Engine <-> KV cache server, the engine's side (pure Python + numpy, no torch, no engine imports).

    base.py            the connector interface: `KVConnectorScheduler` (what to load, what to save)
                       and `KVConnectorWorker` (moves the pages), with their step records
    transfer.py        `ServerConnector`: both sides over the hybridkv KV cache server
    client.py          `KVClient`: the control channel, the registration (segments passed as
                       descriptors), auth; fails fast when no server is connected
    segments.py        `SharedKVBuffers`: the KV cache buffers as sealed memfds that the server
                       maps and copies pages into and out of
    engine_layout.py   the wire `Layout` an engine registers, from the planner's `KVCacheConfig`
    server_process.py  start and stop a `hybridkv server` child process (`kv_server="auto"`, tests)

The contract is docs/design.md §7; it meets the server only through `hybridkv.wire`."""
