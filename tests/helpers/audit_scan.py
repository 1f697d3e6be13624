"""M-30's "never statistics or key material", checked on every record of an audit log
(docs/protocol.md §11): a scan of each record's detail, whatever its event, for what a statistic
or a key would look like there.

A record holds statistics when its detail carries
* an array: a list of more than :data:`MAX_NUMBERS` numbers (a Gram row, a class vector, a
  histogram; the figures a record may carry, ε per site or a gate's per-class AUCs, are few);
* a non-integer number equal (relative 1e-9) to a non-zero entry of one of the ``statistics``
  given (a site's G_k, b_k, their sums: whatever the run computed), in any field;
* a blob: a string of more than :data:`MAX_BLOB_CHARS` hex or base64 characters without spaces
  (a serialized payload; a SHA-256 digest is 64 hex characters and passes);
and key material when its JSON text contains ``PRIVATE KEY`` or the hex or base64 encoding of one
of the ``secrets`` given (a site's raw identity private key, ...).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["MAX_BLOB_CHARS", "MAX_NUMBERS", "statistics_in_audit"]

MAX_NUMBERS = 16
MAX_BLOB_CHARS = 96
_BLOB = re.compile(rf"^[A-Za-z0-9+/=_-]{{{MAX_BLOB_CHARS + 1},}}$")


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def statistics_in_audit(
    records: Sequence[tuple[str, dict[str, object]]],
    *,
    statistics: Sequence[NDArray[np.float64]] = (),
    secrets: Sequence[bytes] = (),
) -> list[str]:
    """Why each (event, detail) record holds statistics or key material (module docstring);
    empty when none does."""
    known = np.unique(
        np.concatenate([np.abs(np.ravel(np.asarray(s, dtype=np.float64))) for s in statistics])
        if statistics
        else np.zeros(0)
    )
    known = known[(known > 0) & np.isfinite(known) & (known != np.round(known))]
    encoded = [e for s in secrets for e in (s.hex(), base64.b64encode(s).decode())]
    found = []
    for event, detail in records:
        text = json.dumps(detail, sort_keys=True)
        if "PRIVATE KEY" in text or any(e in text for e in encoded):
            found.append(f"{event}: key material")
        for path, value in _walk(detail, event):
            if isinstance(value, list) and sum(map(_is_number, value)) > MAX_NUMBERS:
                found.append(f"{path}: an array of {len(value)} numbers")
            elif isinstance(value, str) and _BLOB.match(value):
                found.append(f"{path}: a blob of {len(value)} characters")
            elif _is_number(value) and known.size and math.isfinite(value):
                v = abs(float(value))
                i = int(np.searchsorted(known, v))
                near = [known[j] for j in (i - 1, i) if 0 <= j < known.size]
                if v != round(v) and any(abs(v - k) <= 1e-9 * k for k in near):
                    found.append(f"{path}: {value!r} is an entry of a statistic")
    return found
