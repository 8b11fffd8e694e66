"""The engine options `hybridkv run` and `hybridkv serve` share: one declaration each (flag, help,
EngineConfig's default), put on both commands by `with_engine_options` with the cache flags."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from hybridkv.cli.cache_flags import cache_options_of, cache_parameters
from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.engine.config import DEFAULT_MODEL_NAME, EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.kvcache.options import FIELDS

DEFAULTS = EngineConfig.defaults()
F = TypeVar("F", bound=Callable[..., Any])

Model = Annotated[str, typer.Option("--model", "-m", help="HF-format model directory, or the embedded default")]
KVCacheMemoryGiB = Annotated[float, typer.Option(help="KV cache budget in GiB")]
MaxNumBatchedTokens = Annotated[int, typer.Option(help="token budget per step")]
MaxNumSeqs = Annotated[int, typer.Option(help="most requests running at once")]
MaxModelLen = Annotated[int | None, typer.Option(
    help="longest prompt + output (default: the model's limit, at most 4096)")]
BlockSize = Annotated[int, typer.Option(help="attention block size in tokens")]
Seed = Annotated[int, typer.Option(help="sampling seed of requests that set none")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads (0: torch default)")]
KVServer = Annotated[str | None, typer.Option(
    "--kv-server", help="KV cache server: tcp://host:port of a running `hybridkv server`, or auto to start one "
                        "(stopped with this command)")]
KVServerTimeout = Annotated[float, typer.Option("--kv-server-timeout-s", help="bound on each call to the KV cache "
                                                                               "server")]

KVEventsConfigOption = Annotated[str | None, typer.Option(
    "--kv-events-config", help="vLLM's JSON: publish KV cache events over ZMQ as vLLM does (for `hybridkv index`), "
    'e.g. {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}')]

ENGINE_PANEL = "Engine"
#: EngineConfig's fields -> their flag's annotation (the cache knobs come from cache_flags.py)
ENGINE_FLAGS: dict[str, Any] = {
    "kv_cache_memory_gib": KVCacheMemoryGiB, "max_num_batched_tokens": MaxNumBatchedTokens,
    "max_num_seqs": MaxNumSeqs, "max_model_len": MaxModelLen, "block_size": BlockSize, "seed": Seed,
    "num_threads": Threads, "kv_server": KVServer, "kv_server_timeout_s": KVServerTimeout,
    "kv_events_config": KVEventsConfigOption,
}

__all__ = ["DEFAULTS", "DEFAULT_MODEL_NAME", "ENGINE_FLAGS", "Model", "engine_kwargs", "with_engine_options"]


def _in_panel(annotation: Any) -> Any:
    """`annotation` (Annotated[T, typer.Option(...)]) with its option shown in the Engine panel."""
    kind, option = annotation.__origin__, annotation.__metadata__[0]
    option = copy.copy(option)
    option.rich_help_panel = ENGINE_PANEL
    return Annotated[kind, option]


def with_engine_options(command: F) -> F:
    """Replace `command`'s `engine: EngineConfig` parameter by the engine flags (Engine panel) and the
    cache flags (Cache policy panel, `cache_flags.py`); the command gets the checked `EngineConfig`.
    A bad value is one usage error naming its flag, before any model loads."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "engine"]
    engine = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[name],
                                annotation=_in_panel(annotation)) for name, annotation in ENGINE_FLAGS.items()]
    cache = cache_parameters()
    flags = flags_of([*ENGINE_FLAGS, *FIELDS], num_threads="--threads")

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {p.name: kwargs.pop(p.name, p.default) for p in engine}
        options = cache_options_of({p.name: kwargs.pop(p.name) for p in cache if p.name in kwargs})
        try:
            config = EngineConfig(cache=options, **values)
        except ConfigError as exc:
            raise usage_error(str(exc), flags) from None
        return command(*args, engine=config, **kwargs)

    parameters = [*own, *engine, *cache]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper  # type: ignore[return-value]


def engine_kwargs(config: EngineConfig) -> dict[str, Any]:
    """`LLM`'s keywords for `config`: its engine options and its `cache`."""
    return {**{name: getattr(config, name) for name in EngineConfig.option_names()}, "cache": config.cache}
