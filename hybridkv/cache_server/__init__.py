"""The KV cache server (docs/design.md §6): a separate process that stores and returns each
KV cache group's pages. It never imports torch or the engine."""
