"""Did-you-mean hints for names a person typed (config keys, class names, manifest columns).

One rule everywhere: :func:`difflib.get_close_matches` with cutoff 0.75, compared case-blind, so
``Efusion`` suggests ``Effusion`` and ``mask_feature_nrom`` suggests ``mask_feature_norm``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean", "unknown_names"]


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (case-blind), or None when nothing is close."""
    pool = list(dict.fromkeys(candidates))
    lowered = {c.lower(): c for c in pool}
    found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.75)
    return lowered[found[0]] if found else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'X'?)"`` when a candidate is close to ``word``, else ``""``."""
    match = closest(word, candidates)
    return f" (did you mean {match!r}?)" if match is not None and match != word else ""


def unknown_names(names: Iterable[str], known: Iterable[str]) -> str:
    """``"'a' (did you mean 'b'?), 'c'"`` for the ``names`` not in ``known`` ("" if none)."""
    pool = list(known)
    return ", ".join(f"{n!r}{did_you_mean(n, pool)}" for n in names if n not in pool)
