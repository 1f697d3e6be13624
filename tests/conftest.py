"""Fixtures shared across test packages.

* ``federation``: a provisioned federation (CA, server and site kits), built once per module from
  the module's ``FEDERATION`` (a :class:`tests.helpers.federation.FederationSpec`).
* ``documented_tests``: the node ids collected from the test files the docs name
  (tests/test_protocol_doc.py, tests/test_compliance_doc.py), once per session: the ids this
  session itself collected from those files when it collected all of them in full (the suite
  does), else a ``pytest --collect-only`` subprocess.
* ``private_ctx`` / ``public_ctx``: one CKKS context with the vetted parameters and its public
  copy (no secret key), built once per session because key generation is slow. Tests only read
  them (encrypt, decrypt, serialize); none may change them.

The product imports are inside the fixtures so that collecting tests that use neither stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

# One compute thread per process (a caller's own setting wins): the suite runs more pytest
# workers than cores (three per two) and the daemons beside them, where OpenMP/BLAS thread pools
# only contend and spin (DenseNet-121 inference of 10 images on the loaded 2-core machine: 1.6 s
# of CPU with one thread, 10.7 s with two). Set before any test imports torch or numpy;
# subprocesses inherit it.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

# No per-example time limit for property tests: Hypothesis's default (200 ms) failed a CKKS
# example with DeadlineExceeded on the loaded 2-core machine, and a test must not depend on
# machine load. A test's own @settings still sets its example count.
settings.register_profile("afl", deadline=None)
settings.load_profile("afl")

if TYPE_CHECKING:
    from afl.ops.provisioning import ProvisionedFederation

# Shared helper modules that assert: pytest explains their failing asserts as it does in tests.
pytest.register_assert_rewrite(
    "tests.client.imagegen",
    "tests.crypto.secagg_helpers",
    "tests.e2e.dp_scenario",
    "tests.helpers.pipeline",
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (``make test``): three pytest workers for every two usable cores. The suite's
    federations spend much of their time waiting on their own daemons (stage barriers, TLS round
    trips, fsyncs): with one worker per core the 2-core machine was 58 % busy and the suite took
    689 s; three workers, 74 % and 557 s; four, 82 % and 550 s at twice the load average (one run
    each, near idle, 2026-11-27). More workers than that only add load."""
    del config
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU counts
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, (3 * cores + 1) // 2)


# The test files that took longest (the fourteen slowest, measured by `pytest --durations=0 -n 3`
# on the 2-core machine, 2026-11-27, longest first: one worker's seconds): the suite starts them
# first, so that under `--dist loadfile` none of them is the last file a worker starts (the run's
# tail). Any other file keeps its place after them.
LONGEST_FIRST = (
    "tests/e2e/test_federation_sparse.py",  # 157 s
    "tests/adversarial/test_log_history_attacks.py",  # 96 s
    "tests/adversarial/test_malicious_coordinator.py",  # 84 s
    "tests/e2e/test_restart.py",  # 76 s
    "tests/test_operations_doc.py",  # 71 s
    "tests/e2e/test_history_audit.py",  # 67 s
    "tests/e2e/test_federation_mask.py",  # 51 s
    "tests/e2e/test_runs.py",  # 46 s
    "tests/adversarial/test_split_view.py",  # 45 s
    "tests/client/model/test_export.py",  # 41 s
    "tests/flower/test_relay.py",  # 40 s
    "tests/e2e/test_simulate_default.py",  # 38 s
    "tests/e2e/test_federation_ckks.py",  # 37 s
    "tests/e2e/test_federated_evaluation.py",  # 31 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


# Test file -> the node ids (parameters stripped) this session collected from it, for every test
# file collected in full; filled as pytest collects, so ``-m``/``-k`` deselection does not touch it.
_COLLECTED: dict[str, set[str]] = {}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.passed and report.nodeid.endswith(".py") and "::" not in report.nodeid:
        _COLLECTED.setdefault(report.nodeid, set())


def pytest_itemcollected(item: pytest.Item) -> None:
    _COLLECTED.setdefault(item.nodeid.split("::")[0], set()).add(item.nodeid.split("[")[0])


def _collected_in_full(config: pytest.Config) -> dict[str, set[str]] | None:
    """:data:`_COLLECTED`, or None where this session may have collected only part of a file
    (a ``file::name`` argument, ``--lf``/``--ff`` narrowing what is collected)."""
    narrowed = any("::" in str(a) for a in config.args)
    narrowed |= bool(config.getoption("lf", False) or config.getoption("failedfirst", False))
    return None if narrowed else _COLLECTED


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
def documented_tests(request: pytest.FixtureRequest) -> set[str]:
    """The node ids pytest collects from every test file docs/protocol.md or docs/compliance.md
    names: one collection for both documents' tests (this session's own where it has one)."""
    from tests.helpers.doc_tests import collected_node_ids, documented_node_ids

    return collected_node_ids(documented_node_ids(), session=_collected_in_full(request.config))


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
