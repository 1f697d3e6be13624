"""Enrolment proves possession over a fresh server challenge and signs every declared field
(docs/protocol.md §3, M-74): over real mutual TLS, a captured EnrollRequest replayed is refused, a
field changed under the old signature is refused, another site's or an expired challenge is
refused, and the proof covers every field of EnrollRequest."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from afl.crypto.identity import signatures
from afl.ops.provisioning import ProvisionedFederation
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.coordinator import ENROL_CHALLENGE_TTL_S, MAX_OPEN_CHALLENGES, Coordinator
from afl.server.daemon.main import CoordinatorServer
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.store import Store
from tests.helpers.enrol import signed_enrol_request
from tests.helpers.federation import FederationSpec
from tests.server.fakeclient import FakeSite

SITES = ["s1", "s2", "s3"]
D = 8
FEDERATION = FederationSpec(
    sites=SITES,
    federation_id="fed-enrol",
    round_settings={"classes": ["a", "b"], "feature_dim": D, "backbone": "densenet"},
)
Code = grpc.StatusCode


@pytest.fixture
def server(federation: ProvisionedFederation, tmp_path: Path) -> Iterator[int]:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "state")
    running = CoordinatorServer(config, tick_s=0.05)
    port = running.start()
    yield port
    running.stop(None)


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()
    return code


def _request(site: FakeSite, challenge: pb.EnrolChallenge, **fields: Any) -> pb.EnrollRequest:
    declared = {"labelled_classes": ["a"], "feature_dim": D, "backbone": "densenet", **fields}
    return signed_enrol_request(
        site.identity, challenge=challenge, server_public_key=site.server_public_key(), **declared
    )


def test_a_captured_enrolment_replayed_is_refused(
    federation: ProvisionedFederation, server: int
) -> None:
    site = FakeSite("s1", federation.site_dirs["s1"], server)
    challenge = site.challenge()
    assert len(challenge.nonce) == 32 and challenge.site_id == "s1"
    assert challenge.federation_id == "fed-enrol"
    captured = _request(site, challenge)
    assert site.stub.Enroll(captured, timeout=10).site_id == "s1"
    assert _code(lambda: site.stub.Enroll(captured, timeout=10)) == Code.FAILED_PRECONDITION
    # The honest site enrols again with a fresh challenge (re-enrolment is idempotent).
    assert site.enroll(["a"], D).site_id == "s1"
    assert site.challenge().nonce != challenge.nonce
    site.close()


@pytest.mark.parametrize(
    "change",
    [
        {"labelled_classes": ["a", "b"]},
        {"labelled_classes": []},
        {"backbone": "resnet50"},
        {"feature_dim": 0},
        {"software_version": "afl/9"},
        {"role": pb.SITE_ROLE_PARTICIPANT},
    ],
)
def test_a_field_changed_under_the_signature_is_refused(
    federation: ProvisionedFederation, server: int, change: dict[str, Any]
) -> None:
    site = FakeSite("s1", federation.site_dirs["s1"], server)
    challenge = site.challenge()
    honest = _request(site, challenge)
    tampered = pb.EnrollRequest()
    tampered.CopyFrom(honest)
    for name, value in change.items():
        if name == "labelled_classes":
            del tampered.labelled_classes[:]
            tampered.labelled_classes.extend(value)
        else:
            setattr(tampered, name, value)
    assert _code(lambda: site.stub.Enroll(tampered, timeout=10)) == Code.PERMISSION_DENIED
    # The challenge was used by that attempt: the honest request with it is refused too.
    assert _code(lambda: site.stub.Enroll(honest, timeout=10)) == Code.FAILED_PRECONDITION
    assert not site.status().enrolled
    site.close()


def test_a_site_that_speaks_another_wire_version_is_refused_naming_both(
    federation: ProvisionedFederation, server: int
) -> None:
    site = FakeSite("s1", federation.site_dirs["s1"], server)
    old = _request(site, site.challenge(), protocol_version=wire.PROTOCOL_VERSION - 1)
    with pytest.raises(grpc.RpcError) as info:
        site.stub.Enroll(old, timeout=10)
    assert info.value.code() == Code.FAILED_PRECONDITION
    assert (
        f"speaks wire protocol {wire.PROTOCOL_VERSION - 1}, the coordinator speaks "
        f"{wire.PROTOCOL_VERSION}" in str(info.value.details())
    )
    assert not site.status().enrolled
    assert site.enroll(["a"], D).site_id == "s1"  # the same site, speaking this version
    site.close()


def test_no_challenge_or_another_sites_challenge_is_refused(
    federation: ProvisionedFederation, server: int
) -> None:
    s1 = FakeSite("s1", federation.site_dirs["s1"], server)
    s2 = FakeSite("s2", federation.site_dirs["s2"], server)
    foreign = s2.challenge()
    # s1 signs over s2's nonce (as if for itself): the nonce is bound to s2's certificate.
    borrowed = _request(s1, replace_site(foreign, "s1"))
    assert _code(lambda: s1.stub.Enroll(borrowed, timeout=10)) == Code.FAILED_PRECONDITION
    no_challenge = _request(s1, pb.EnrolChallenge(federation_id="fed-enrol", site_id="s1"))
    assert _code(lambda: s1.stub.Enroll(no_challenge, timeout=10)) == Code.FAILED_PRECONDITION
    # s2's own nonce is still open for s2.
    assert s2.stub.Enroll(_request(s2, foreign), timeout=10).site_id == "s2"
    s1.close()
    s2.close()


def replace_site(challenge: pb.EnrolChallenge, site_id: str) -> pb.EnrolChallenge:
    copy = pb.EnrolChallenge()
    copy.CopyFrom(challenge)
    copy.site_id = site_id
    return copy


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _coordinator(fed: ProvisionedFederation, state: Path, clock: _Clock) -> Coordinator:
    config = replace(load_config(fed.server_dir / "server.toml"), state_dir=state)
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    store = Store(state, federation_id=config.federation_id)
    return Coordinator(config, store, key, clock=clock)


def _identity(fed: ProvisionedFederation, site: str) -> Any:
    return signatures.load_private_key_pem((fed.site_dirs[site] / "identity.key").read_bytes())


def test_challenges_expire_and_are_bounded_per_site(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    clock = _Clock()
    coordinator = _coordinator(federation, tmp_path / "state", clock)
    key = coordinator.config.identity_public_key
    identity = _identity(federation, "s3")

    def request(challenge: pb.EnrolChallenge) -> pb.EnrollRequest:
        return signed_enrol_request(identity, challenge=challenge, server_public_key=key)

    old = coordinator.enrol_challenge("s3")
    assert old.expires_unix_ms == int((clock.now + ENROL_CHALLENGE_TTL_S) * 1000)
    clock.now += ENROL_CHALLENGE_TTL_S + 1
    with pytest.raises(WrongStageError, match="expired"):
        coordinator.enroll("s3", request(old))
    # Only the newest MAX_OPEN_CHALLENGES stay open: asking many times never grows the table.
    issued = [coordinator.enrol_challenge("s3") for _ in range(MAX_OPEN_CHALLENGES + 2)]
    with pytest.raises(WrongStageError, match="unknown or already used"):
        coordinator.enroll("s3", request(issued[0]))
    assert coordinator.enroll("s3", request(issued[-1])).site_id == "s3"
    with pytest.raises(NotPermittedError, match="not provisioned"):
        coordinator.enrol_challenge("stranger")


def _distinct(field: Any) -> Any:
    """A value of ``field``'s type other than its default."""
    if field.is_repeated:
        return ["x"]
    kind = field.type
    if kind == field.TYPE_BYTES:
        return b"\x01" * 32
    if kind == field.TYPE_STRING:
        return "x"
    if kind == field.TYPE_ENUM:
        return 2
    return 7


def test_the_proof_covers_every_field_of_the_request() -> None:
    """Fail closed: a field added to EnrollRequest without being signed fails here."""
    base = pb.EnrollRequest()
    names = [f.name for f in pb.EnrollRequest.DESCRIPTOR.fields if f.name != "proof"]
    assert {"challenge", "labelled_classes", "backbone", "role"} <= set(names)

    def fields_of(request: pb.EnrollRequest) -> list[Any]:
        return wire.enrol_proof_fields(
            request, federation_id="f", site_id="s", server_identity_public_key=b"\x02" * 32
        )

    for field in pb.EnrollRequest.DESCRIPTOR.fields:
        if field.name == "proof":
            continue
        changed = pb.EnrollRequest()
        value = _distinct(field)
        if field.is_repeated:
            getattr(changed, field.name).extend(value)
        else:
            setattr(changed, field.name, value)
        assert fields_of(changed) != fields_of(base), field.name
    args: dict[str, Any] = {
        "federation_id": "f",
        "site_id": "s",
        "server_identity_public_key": b"\x02" * 32,
    }
    other: dict[str, Any] = {"federation_id": "g", "site_id": "t"}
    other["server_identity_public_key"] = b"\x03" * 32
    for name, value in other.items():
        assert wire.enrol_proof_fields(base, **{**args, name: value}) != fields_of(base), name
