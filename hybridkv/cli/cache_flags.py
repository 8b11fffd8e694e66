"""The "Cache policy" flags: `--preset` and one flag per `CacheOptions` field, declared once.

`run`, `serve` and `simulate` take them through `with_cache_options`: the command is written with a
`cache: CacheOptions` parameter, and the decorator puts `--preset` and the per-field flags in its
place (all in one `--help` panel). A flag left out keeps the preset's value, so

    hybridkv simulate MODEL --preset hybridkv --eviction lru

is the project's best setting with vLLM's eviction. A new knob is a `CacheOptions` field plus its
help (`kvcache/options.py`); no command changes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.errors import ConfigError
from hybridkv.kvcache.options import DEFAULT_PRESET, ENUM_FIELDS, FIELDS, PRESETS, CacheOptions, options_from

PANEL = "Cache policy"

#: Per field: its help line (the flag is `--` + the name with dashes); fields without help (`events`)
#: are not flags.
HELP: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(CacheOptions) if "help" in f.metadata}
ALIASES = {"prefix_match_unit": ("--hash-block-size",), "checkpoint_interval_tokens": ("--checkpoint-interval",)}
#: field name -> its flag, for errors (`usage_error` renames a message's leading field name)
CACHE_FLAGS = flags_of(list(HELP))
Preset = Enum("Preset", {name: name for name in PRESETS}, type=str)  # type: ignore[misc]

F = TypeVar("F", bound=Callable[..., Any])


def _flag_type(name: str) -> Any:
    """The flag's type: the field's enum, int or bool, optional (None: the preset's value)."""
    kind = ENUM_FIELDS.get(name)
    if kind is not None:
        return kind | None
    if name == "cache_aware_admission_threshold":
        return float | None
    return bool | None if name == "turn_checkpoints" else int | None


def cache_parameters() -> list[inspect.Parameter]:
    """`--preset` and one keyword parameter per field in `HELP`, each in the Cache policy panel."""
    preset_help = (f"start from a named setting: vllm (vLLM 0.32's behaviour flag for flag) or hybridkv (the best "
                   f"setting measured here); the flags below change single knobs. Default: {DEFAULT_PRESET}")
    params = [inspect.Parameter("preset", inspect.Parameter.KEYWORD_ONLY, default=Preset(DEFAULT_PRESET),
                                annotation=Annotated[Preset, typer.Option("--preset", help=preset_help,
                                                                          rich_help_panel=PANEL)])]
    for name in FIELDS:
        if name not in HELP:
            continue
        flag = "--" + name.replace("_", "-")
        names = (f"{flag}/--no-{flag[2:]}",) if name == "turn_checkpoints" else (flag, *ALIASES.get(name, ()))
        option = typer.Option(*names, help=HELP[name] + " [default: the preset's]", rich_help_panel=PANEL,
                              show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[_flag_type(name), option]))
    return params


def cache_options_of(values: dict[str, Any]) -> CacheOptions:
    """The `CacheOptions` of the flags' values (`preset` plus the fields given); a bad combination is
    a usage error naming the option."""
    preset = values.pop("preset", DEFAULT_PRESET)
    changes = {k: v for k, v in values.items() if v is not None}
    try:
        return options_from(preset.value if isinstance(preset, Enum) else str(preset), changes)
    except ConfigError as exc:
        raise usage_error(str(exc), CACHE_FLAGS) from None


def with_cache_options(command: F) -> F:
    """Replace `command`'s `cache: CacheOptions` parameter by the Cache policy flags (module docstring)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "cache"]
    added = cache_parameters()
    names = [p.name for p in added]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cache = cache_options_of({name: kwargs.pop(name) for name in names if name in kwargs})
        return command(*args, cache=cache, **kwargs)

    parameters = [*own, *added]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper  # type: ignore[return-value]
