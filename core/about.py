"""The installed afl version, for ``--version`` and reports."""

from __future__ import annotations

from importlib import metadata

__all__ = ["afl_version"]


def afl_version() -> str:
    """The version of the installed ``afl`` distribution ("0+unknown" when not installed)."""
    try:
        return metadata.version("afl")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "0+unknown"
