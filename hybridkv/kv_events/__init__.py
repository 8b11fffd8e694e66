"""vLLM's KV event stream: the wire format (`wire`) and the ZMQ publisher (`publisher`), shared by
the engine's publisher, the KV cache server's tiers and the index that consumes them."""
