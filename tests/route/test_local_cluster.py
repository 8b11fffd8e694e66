"""`hybridkv route --engines N`'s cluster: real `hybridkv serve` subprocesses publishing over ipc://,
registered in an in-process index; the second request of a prefix is predicted and hit."""

from __future__ import annotations

import json

import pytest

from hybridkv.index.http import AppServer
from hybridkv.route.app import RouteConfig, make_app
from hybridkv.route.local import LocalCluster
from hybridkv.route.picker import Policy
from hybridkv.route.upstream import call
from tests.index.test_index_service import wait_for


@pytest.mark.slow
def test_a_local_cluster_routes_and_predicts() -> None:
    cluster = LocalCluster(1, model="default-gemma3", engine_args="--kv-cache-memory-gib 0.05 --threads 1")
    try:
        cfg = RouteConfig(engines=cluster.engines(), index_url=cluster.index_url, model=cluster.model,
                          policy=Policy.JOINT)
        router = AppServer(make_app(cfg), lifespan="on")
        router.start()
        prompt = list(range(3, 200))
        body = {"model": cluster.model, "prompt": prompt, "max_tokens": 1}
        assert call(router.url, "/v1/completions", body)[0] == 200
        engine = cfg.engines[0].instance_id
        wait_for(lambda: json.loads(call(cluster.index_url, "/query", {"model": cluster.model, "token_ids": prompt})[1])
                 ["default"][engine]["longest_matched"] > 0)
        status, raw = call(router.url, "/v1/completions", {**body, "prompt": [*prompt, 7]})
        assert status == 200 and json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
        assert cfg.engines[0].exact == cfg.engines[0].checked == 2  # (the first: 0 predicted, 0 found)
        router.stop()
    finally:
        cluster.close()


def test_a_cluster_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LocalCluster(0, model="default-gemma3")
