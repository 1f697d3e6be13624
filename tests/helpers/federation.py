"""What a test module declares to get the shared ``federation`` fixture (tests/conftest.py).

A module sets ``FEDERATION = FederationSpec(sites=[...], ...)``; the fixture provisions that
federation once per module with :func:`afl.ops.provisioning.provision`. The keys are
``provision``'s keyword arguments.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Required, TypedDict

from afl.server import toml_text
from afl.server.toml_text import TomlValue


class FederationSpec(TypedDict, total=False):
    """Keyword arguments of :func:`afl.ops.provisioning.provision` (all but ``out_dir``)."""

    sites: Required[Sequence[str]]
    federation_id: str
    decryptor: str
    port: int
    round_settings: Mapping[str, TomlValue]


def rewrite_client_toml(kit: Path, tmp: Path, **sections: Mapping[str, object]) -> Path:
    """A copy of a provisioned site kit in ``tmp/kit`` whose client.toml has ``sections``'
    keys set (a value None removes the key); returns the new client.toml."""
    doc = tomllib.loads((kit / "client.toml").read_text())
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
        for key, value in list(doc[name].items()):
            if value is None:
                del doc[name][key]
    out = tmp / "kit"
    out.mkdir(exist_ok=True)
    for f in kit.iterdir():
        if f.is_file() and f.name != "client.toml":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "client.toml").write_text(toml_text.dumps(doc))
    return out / "client.toml"
