"""hybridkv: a hybrid KV cache planner, manager, reference engine and KV cache server."""

__version__ = "0.1.0"
