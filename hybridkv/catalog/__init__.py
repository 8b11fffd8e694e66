"""A catalog of real, public model configs, so models can be planned by name without a download.

`models.json` (shipped as package data) holds, for each model, the fields of its Hugging Face
`config.json` that a KV cache planner reads -- layer counts, head counts and sizes, window and chunk
sizes, layer type lists, Mamba / Gated DeltaNet state shapes -- plus `model_type`, `architectures`,
the dtype and `max_position_embeddings`. Field names are exactly those of the Hub file, and
multimodal models keep their top-level `model_type` with a nested `text_config`, as on the Hub.
Every entry records in `source` where each value came from.

Pure Python: no torch, no network.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from hybridkv.errors import ConfigError

__all__ = ["CatalogEntry", "catalog", "find"]

_DATA_FILE = "models.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogEntry:
    """One model of the catalog.

    Attributes:
        hf_id: The Hugging Face model id, e.g. ``"google/gemma-3-27b-it"``.
        aliases: Short names that also find this entry, e.g. ``("gemma-3-27b",)``.
        source: Where the values came from (URLs or repository and path), field by field.
        config: The planner-relevant subset of the model's ``config.json``, keys as on the Hub.
    """

    hf_id: str
    aliases: tuple[str, ...]
    source: str
    config: dict[str, Any]

    def names(self) -> tuple[str, ...]:
        """Every name `find` accepts for this entry: the id, its part after ``/`` and the aliases."""
        short = self.hf_id.rsplit("/", 1)[-1]
        return (self.hf_id, short, *self.aliases)


def _fail(where: str, what: str) -> ConfigError:
    return ConfigError(f"hybridkv catalog {_DATA_FILE}: {where}: {what}")


def _parse_entry(index: int, raw: object) -> CatalogEntry:
    where = f"models[{index}]"
    if not isinstance(raw, dict):
        raise _fail(where, f"expected an object, got {type(raw).__name__}")
    hf_id = raw.get("hf_id")
    if not isinstance(hf_id, str) or "/" not in hf_id:
        raise _fail(where, f"hf_id must be a string 'owner/name', got {hf_id!r}")
    where = f"{where} ({hf_id})"
    aliases = raw.get("aliases")
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise _fail(where, f"aliases must be a list of non-empty strings, got {aliases!r}")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        raise _fail(where, "source must be a non-empty string")
    config = raw.get("config")
    if not isinstance(config, dict):
        raise _fail(where, f"config must be an object, got {type(config).__name__}")
    if not isinstance(config.get("model_type"), str):
        raise _fail(where, "config has no string model_type")
    return CatalogEntry(hf_id=hf_id, aliases=tuple(aliases), source=source, config=config)


@lru_cache(maxsize=1)
def _load() -> tuple[CatalogEntry, ...]:
    """Read and validate the packaged data once; later calls reuse it."""
    text = resources.files(__name__).joinpath(_DATA_FILE).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail("file", f"not valid JSON ({exc})") from exc
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, list):
        raise _fail("file", "expected an object with a 'models' list")
    entries = tuple(_parse_entry(i, raw) for i, raw in enumerate(models))
    seen: dict[str, str] = {}
    for entry in entries:
        for name in {n.lower() for n in entry.names()}:
            if name in seen:
                raise _fail(entry.hf_id, f"name {name!r} is also used by {seen[name]}")
            seen[name] = entry.hf_id
    return entries


def _copy(entry: CatalogEntry) -> CatalogEntry:
    # The cached configs are shared; hand out copies so callers may edit what they get.
    return CatalogEntry(
        hf_id=entry.hf_id, aliases=entry.aliases, source=entry.source, config=copy.deepcopy(entry.config)
    )


def catalog() -> list[CatalogEntry]:
    """Return every catalog entry, in file order (each call returns fresh copies of the configs)."""
    return [_copy(entry) for entry in _load()]


def find(name: str) -> CatalogEntry | None:
    """Look a model up by Hugging Face id, by the id's name part or by alias, ignoring case.

    Args:
        name: e.g. ``"google/gemma-3-27b-it"``, ``"gemma-3-27b-it"`` or ``"GPT-OSS-20B"``.

    Returns:
        A copy of the matching entry, or ``None`` when no entry has that name.
    """
    wanted = name.strip().lower()
    for entry in _load():
        if wanted in (n.lower() for n in entry.names()):
            return _copy(entry)
    return None
