"""Count the calls a test's code makes to one function of a module (the real function still
runs): a check that work is done once, or not at all, fails when it is repeated."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

__all__ = ["record_calls"]


def record_calls(
    monkeypatch: pytest.MonkeyPatch,
    module: ModuleType,
    name: str,
    key: Callable[..., Any] = lambda *args, **kwargs: args[0] if args else None,
) -> list[Any]:
    """Replace ``module.name`` (for the test) by a wrapper that appends ``key(*args,
    **kwargs)`` to the returned list, then calls the real function."""
    real = getattr(module, name)
    seen: list[Any] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen.append(key(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen
