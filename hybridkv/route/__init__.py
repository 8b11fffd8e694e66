"""`hybridkv route`: an OpenAI-compatible proxy over N engines that sends each request where the
KV cache index says its prefix is cached (the joint hybrid hit), balanced by load.

    picker.py     the choice: policy (joint / attention / round robin), load, failures
    upstream.py   blocking HTTP to engines and the index (run in threads), streaming included
    app.py        the Starlette app: /v1/completions, /v1/chat/completions, /v1/models, /metrics, /route/stats
    local.py      N local `hybridkv serve` engines and an index, for a one-command setup

docs/routing.md: the policy, and how llm-d's and Dynamo's routers query the same index.
"""
