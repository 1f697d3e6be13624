"""Fixtures shared across test packages.

* ``federation``: a provisioned federation (CA, server and site kits), built once per module from
  the module's ``FEDERATION`` (a :class:`tests.helpers.federation.FederationSpec`).
* ``documented_tests``: the node ids collected from the test files the docs name
  (tests/test_protocol_doc.py, tests/test_compliance_doc.py), collected once per session.
* ``private_ctx`` / ``public_ctx``: one CKKS context with the vetted parameters and its public
  copy (no secret key), built once per session because key generation is slow. Tests only read
  them (encrypt, decrypt, serialize); none may change them.

The product imports are inside the fixtures so that collecting tests that use neither stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from afl.ops.provisioning import ProvisionedFederation

# Shared helper modules that assert: pytest explains their failing asserts as it does in tests.
pytest.register_assert_rewrite(
    "tests.client.imagegen",
    "tests.crypto.secagg_helpers",
    "tests.e2e.dp_scenario",
    "tests.helpers.pipeline",
)


@pytest.fixture(scope="module")
def federation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ProvisionedFederation:
    """The federation the requesting module declares as ``FEDERATION``, provisioned once."""
    from afl.ops.provisioning import provision

    spec = getattr(request.module, "FEDERATION", None)
    if not isinstance(spec, dict):
        raise pytest.UsageError(
            f"{request.module.__name__} uses the federation fixture but declares no "
            "FEDERATION = FederationSpec(...) (tests/helpers/federation.py)"
        )
    return provision(tmp_path_factory.mktemp("fed") / "federation", **spec)


@pytest.fixture(scope="session")
def documented_tests() -> set[str]:
    """The node ids pytest collects from every test file docs/protocol.md or docs/compliance.md
    names: one collection for both documents' tests."""
    from tests.helpers.doc_tests import collected_node_ids, documented_node_ids

    return collected_node_ids(documented_node_ids())


@pytest.fixture(scope="session")
def private_ctx() -> Any:
    """A CKKS context holding the secret key (what only the decryptor site has)."""
    from afl.crypto.ckks import scheme as ckks

    return ckks.create_private_context(n_threads=1)


@pytest.fixture(scope="session")
def public_ctx(private_ctx: Any) -> Any:
    """The public copy of ``private_ctx``, loaded as servers and data sites load it."""
    from afl.crypto.ckks import scheme as ckks

    return ckks.load_public_context(ckks.public_context_bytes(private_ctx))
