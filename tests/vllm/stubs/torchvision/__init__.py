"""A Python-only stand-in for torchvision, for the vLLM tests only.

vLLM 0.32's Qwen3.5 module imports transformers' image processors, which import torchvision at module
level; the CUDA-linked torchvision the index resolves breaks `import transformers`, and a text-only model
never calls it. Every `torchvision.*` module and attribute resolves to an inert placeholder class."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__version__ = "0.0.0"


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    return _AnyMeta(name, (), {})


class _AnyModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AnyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder())


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(name)
