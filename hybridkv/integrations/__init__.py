"""Connectors that other engines load by module path (optional extras; nothing in hybridkv imports them).

`hybridkv.integrations.vllm`: the vLLM V1 KV connector (`pip install hybridkv[vllm]`)."""
