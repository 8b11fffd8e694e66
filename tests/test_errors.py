"""The error hierarchy: every manager error is a HybridKVError, importable from its old module too."""

from __future__ import annotations

import pytest

from hybridkv import errors
from hybridkv.kvcache import block_pool, eviction, manager


@pytest.mark.parametrize(("name", "builtin"), [
    ("AllocationError", ValueError),
    ("StaleHitError", ValueError),
    ("UnknownRequestError", KeyError),
    ("IntegrityError", RuntimeError),
    ("ConfigError", ValueError),
    ("UnsupportedModelError", KeyError),
    ("CapacityError", ValueError),
])
def test_every_error_is_a_hybridkv_error_and_the_builtin_that_fits(name: str, builtin: type[Exception]) -> None:
    error = getattr(errors, name)
    assert issubclass(error, errors.HybridKVError)
    assert issubclass(error, builtin)


def test_stale_hit_is_an_allocation_error() -> None:
    assert issubclass(errors.StaleHitError, errors.AllocationError)


def test_old_import_paths_re_export_the_same_classes() -> None:
    assert block_pool.IntegrityError is errors.IntegrityError
    assert eviction.IntegrityError is errors.IntegrityError
    for name in ("AllocationError", "StaleHitError", "UnknownRequestError", "IntegrityError"):
        assert getattr(manager, name) is getattr(errors, name)
        assert name in manager.__all__


def test_key_error_subclasses_keep_their_message_unquoted() -> None:
    assert str(errors.UnknownRequestError("request 'a' holds no blocks")) == "request 'a' holds no blocks"
    assert str(errors.UnknownRequestError()) == ""
