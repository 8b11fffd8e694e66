"""JSON from a user's file (a config.json, one trace line), read with bounds: a size limit, a nesting
limit checked before parsing (json recurses once per level), and no NaN, Infinity or float that
overflows to infinity (json accepts all three). Every refusal is one `ConfigError` line naming what
was read, what was found and what is allowed.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hybridkv.errors import ConfigError

MAX_DEPTH = 64  # real config.json files nest 3-4 levels deep
MAX_CONFIG_BYTES = 16 << 20  # a config.json (the largest real ones are ~100 KiB)
MAX_LINE_BYTES = 64 << 20  # one trace line (a 4M-token prompt of token ids)


def _depth(text: str, limit: int) -> int:
    """The deepest nesting of `text` (strings skipped), stopping once it passes `limit`."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows (expected a finite number)")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} overflows a float (expected a finite number)")
    return value


def loads(text: str, *, what: str, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `text`, the whole of file `what`; ConfigError for anything over the bounds
    above or not strict JSON."""
    try:
        return _parse(text, what, max_bytes, max_depth)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None


def loads_line(line: str, *, where: str, max_bytes: int = MAX_LINE_BYTES) -> Any:
    """The JSON value of one line of a file (`where`: e.g. "trace line 3"); as `loads`."""
    try:
        return _parse(line, where, max_bytes, MAX_DEPTH)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None


def _parse(text: str, what: str, max_bytes: int, max_depth: int) -> Any:
    if len(text) > max_bytes:
        raise ConfigError(f"{what} has {len(text)} characters; at most {max_bytes} are read")
    if _depth(text, max_depth) > max_depth:
        raise ConfigError(f"{what} nests deeper than {max_depth} levels; expected a JSON value at most {max_depth} "
                          "levels deep")
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # NaN / Infinity / an overflowing float
        raise ConfigError(f"{what}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to read") from None
