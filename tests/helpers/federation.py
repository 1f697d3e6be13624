"""What a test module declares to get the shared ``federation`` fixture (tests/conftest.py).

A module sets ``FEDERATION = FederationSpec(sites=[...], ...)``; the fixture provisions that
federation once per module with :func:`afl.ops.provisioning.provision`. The keys are
``provision``'s keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Required, TypedDict

from afl.server.toml_text import TomlValue


class FederationSpec(TypedDict, total=False):
    """Keyword arguments of :func:`afl.ops.provisioning.provision` (all but ``out_dir``)."""

    sites: Required[Sequence[str]]
    federation_id: str
    decryptor: str
    port: int
    round_settings: Mapping[str, TomlValue]
