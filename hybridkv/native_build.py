"""Build a C shared object on first use with the system's compiler, cached by a hash of what goes in.

The engine's kernels (`engine/kernels`) and the index's hash loop (`index/native.py`) are compiled with
`$CC` (default `cc`) into `$HYBRIDKV_KERNEL_CACHE` (default `~/.cache/hybridkv/kernels`), named
`<stem>-<hash of the sources, flags, compiler and extra key>.so`, built aside and renamed (atomic for
concurrent first uses: pytest-xdist, several engines). `HYBRIDKV_KERNELS=0` turns every one off.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["kernels_enabled", "shared_object"]


def kernels_enabled() -> bool:
    """False when `HYBRIDKV_KERNELS=0` asks for the pure-Python / plain-torch paths."""
    return os.environ.get("HYBRIDKV_KERNELS", "1") != "0"


def shared_object(stem: str, sources: Sequence[Path], *, flags: Sequence[str], libs: Sequence[str] = (),
                  key_files: Sequence[Path] = (), extra_key: str = "") -> Path:
    """The path of the shared object built from `sources`, compiling it first if it is not cached.

    Raises:
        OSError: the compiler is missing or failed (its exit status and the start of its stderr).
    """
    compiler = os.environ.get("CC", "cc")
    parts = [*(path.read_bytes() for path in (*sources, *key_files)), " ".join((*flags, *libs)).encode(),
             compiler.encode(), extra_key.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    cache = Path(os.environ.get("HYBRIDKV_KERNEL_CACHE", Path.home() / ".cache" / "hybridkv" / "kernels"))
    target = cache / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        try:
            result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(partial), *libs],
                                    capture_output=True, text=True, check=False)
        except (OSError, subprocess.SubprocessError) as error:
            raise OSError(f"{compiler} could not run: {error}") from error
        if result.returncode != 0:
            raise OSError(f"{compiler} failed (exit {result.returncode}): {result.stderr.strip()[:2000]}")
        os.replace(partial, target)
    return target
