"""`hybridkv route`: the reference cache-aware router (hybridkv/route/, docs/routing.md)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from hybridkv.cli.errors import usage_error
from hybridkv.errors import HybridKVError

if TYPE_CHECKING:
    from hybridkv.route.app import RouteConfig
    from hybridkv.route.local import LocalCluster


def route_command(
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", help="an engine's http://host:port (repeat; registered in the index under this URL)")] = None,
    engines: Annotated[int, typer.Option("--engines", help="start N local `hybridkv serve` engines and an index "
                                         "instead (a one-command setup)")] = 0,
    index: Annotated[str | None, typer.Option("--index", help="a running `hybridkv index` (http://host:port)")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="the model name clients send (and, with --engines, "
                                       "the model the engines serve)")] = "default-gemma3",
    engine_args: Annotated[str, typer.Option("--engine-args", help="more `hybridkv serve` flags for --engines, "
                                             "as one string")] = "",
    policy: Annotated[str, typer.Option("--policy", help="joint (the index's joint hybrid hit), attention "
                                        "(its attention-only number) or round_robin")] = "joint",
    host: Annotated[str, typer.Option("--host", help="bind address (loopback only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (0: any free port)")] = 8100,
    max_skew: Annotated[int, typer.Option("--max-skew", help="requests an engine may run beyond the least loaded "
                                          "one and still be chosen for its hit")] = 2,
    sync_wait_s: Annotated[float, typer.Option("--sync-wait-s", help="how long to ask the index again while it "
                                               "has not applied events an engine already reported")] = 0.05,
) -> None:
    """Route OpenAI requests over engines by the index's joint hybrid hit, balanced by load."""
    from hybridkv.http_serving import tune_for_latency
    from hybridkv.index.auth import check_bind, index_token
    from hybridkv.index.http import AppServer
    from hybridkv.route.app import RouteConfig, make_app
    from hybridkv.route.local import LocalCluster
    from hybridkv.route.picker import Engine, Policy

    try:
        chosen = Policy(policy)
    except ValueError:
        raise usage_error(f"--policy must be one of {[p.value for p in Policy]}, got {policy!r}") from None
    if bool(engine) == bool(engines):
        raise usage_error("pass --engine URL (repeated) or --engines N, not both and not neither")
    if max_skew < 0 or not 0 <= sync_wait_s <= 10:
        raise usage_error(f"--max-skew must be >= 0 and --sync-wait-s in 0..10, got {max_skew} and {sync_wait_s}")
    cluster: LocalCluster | None = None
    cfg: RouteConfig | None = None
    index_url: str | None = index
    try:
        check_bind(host, allow_remote=False, token="")
        if engines:
            typer.echo(f"starting {engines} engines of {model} and an index ...", err=True)
            cluster = LocalCluster(engines, model=model, engine_args=engine_args)
            pool, index_url = cluster.engines(), cluster.index_url
        else:
            pool = [Engine(url=u.rstrip("/"), instance_id=u.rstrip("/")) for u in engine or []]
        cfg = RouteConfig(engines=pool, index_url=index_url, model=model, policy=chosen, max_skew=max_skew,
                          sync_wait_s=sync_wait_s, index_token=index_token(None))
        server = AppServer(make_app(cfg), host=host, port=port, name="hybridkv-route", lifespan="on")
        typer.echo(f"hybridkv route on {server.url} over {len(pool)} engines (index {index_url or 'none'}, "
                   f"policy {chosen.value}); Ctrl-C to stop", err=True)
        tune_for_latency()
        server.run()
    except (HybridKVError, OSError, RuntimeError, ValueError) as e:
        raise usage_error(str(e)) from None
    finally:
        if cluster is not None:
            for row in make_stats(cfg):
                typer.echo(row, err=True)
            cluster.close()


def make_stats(cfg: RouteConfig | None) -> list[str]:
    """One line per engine: requests routed, predicted and realized prefix hits."""
    if cfg is None:
        return []
    return [json.dumps({"instance": e.instance_id, "routed": e.routed, "predicted_tokens": e.predicted_tokens,
                        "cached_tokens": e.cached_tokens, "prompt_tokens": e.prompt_tokens}) for e in cfg.engines]
