"""A site's requests to an in-process :class:`afl.server.coordinator.Coordinator`, for tests
that drive the coordinator without the site daemon: enrolment, a signed plan acceptance, plaintext
uploads and a whole round of them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import (
    PLAN_DECISION_CONTEXT,
    blob_sha256,
    plan_decision_fields,
)
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import AssembledPayload
from afl.server.plan.release import PlannedRelease, RoundView
from tests.helpers.enrol import enrol_in_process


def site_key(federation: Any, site: str) -> Any:
    """The identity key of a provisioned site's kit."""
    return signatures.load_private_key_pem(
        (federation.site_dirs[site] / "identity.key").read_bytes()
    )


def enrolled_coordinator(federation: Any, sites: Sequence[str]) -> Any:
    """A :class:`afl.server.coordinator.Coordinator` over the provisioned federation's
    server.toml, identity key and state folder, with ``sites`` enrolled."""
    from afl.server.config import load_config
    from afl.server.coordinator import Coordinator
    from afl.server.store import Store

    server_dir = federation.server_dir
    config = load_config(server_dir / "server.toml")
    key = signatures.load_private_key_pem((server_dir / "identity.key").read_bytes())
    coordinator = Coordinator(
        config, Store(config.state_dir, federation_id=config.federation_id), key
    )
    for site in sites:
        enrol(coordinator, federation, site)
    return coordinator


def enrol(
    coordinator: Any,
    federation: Any,
    site: str,
    *,
    labelled: Sequence[str] = (),
    feature_dim: int = 0,
) -> pb.EnrollResponse:
    """``site`` enrols over a fresh challenge with its kit's identity key."""
    return enrol_in_process(
        coordinator,
        site,
        site_key(federation, site),
        labelled_classes=labelled,
        feature_dim=feature_dim,
    )


def accept_plan(coordinator: Any, federation: Any, site: str, view: RoundView) -> None:
    """``site`` accepts the signed plan of ``view``."""
    assert view.row.plan is not None
    digest = blob_sha256(view.row.plan)
    fields = plan_decision_fields(round_id=view.round_id, accept=True, plan_sha256=digest)
    signature = signatures.sign_fields(
        site_key(federation, site), context=PLAN_DECISION_CONTEXT, fields=fields
    )
    coordinator.decide(
        site,
        pb.PlanDecision(
            round_id=view.round_id, accept=True, plan_sha256=digest, signature=signature
        ),
    )


def upload(coordinator: Any, site: str, view: RoundView, release: str, values: Any) -> None:
    """``site`` uploads ``values`` as little-endian float64 to ``release`` of ``view``."""
    data = np.asarray(values, dtype="<f8").tobytes()
    digest = hashlib.sha256(data).digest()
    payload = AssembledPayload(view.round_id, release, pb.PAYLOAD_KIND_STATISTIC, data, digest)
    coordinator.upload(site, payload)


def complete_round(
    coordinator: Any,
    federation: Any,
    values: Callable[[str, PlannedRelease], Any] = lambda site, r: np.zeros(r.length),
) -> None:
    """Every participant of the current round accepts its plan and uploads ``values(site,
    release)`` (default zeros) to each release it is a member of."""
    view = coordinator.find("")
    for site in view.row.participants:
        accept_plan(coordinator, federation, site, view)
    for site in view.row.participants:
        for release in view.releases:
            if site in release.members:
                upload(coordinator, site, view, release.name, values(site, release))
