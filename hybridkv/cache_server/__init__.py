"""The KV cache server (design.md section 6): a separate process that stores and returns each
KV cache group's pages. It never imports torch or the engine."""
