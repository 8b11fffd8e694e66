"""Engine <-> KV cache server: the client library (pure Python + numpy) and, next, the
connector that wires an engine's scheduler and runner to it."""
