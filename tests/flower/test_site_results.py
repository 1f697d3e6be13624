"""A Flower site checks the results of its previous calls (afl.flower.site.check_results,
docs/flower.md §3): the enrolment reply against its kit and every upload receipt against what it
sent. A result the relay leaves out is a failure, never a check skipped: a relay that drops the
enrolment reply or a receipt cannot have the site go on as if the coordinator had confirmed it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from afl.client.config import ClientConfig, DataConfig, TlsPaths
from afl.client.daemon.transport import DaemonError, RemoteCallError, UploadError
from afl.flower.envelope import Answer, ToSite
from afl.flower.site import Session, check_results
from afl.proto.v1 import coordinator_pb2 as pb

FED, SITE = "fed-results", "site-1"
SERVER_KEY = bytes(range(32))
PAYLOAD = b"the statistics of one slot"
DIGEST = hashlib.sha256(PAYLOAD).digest()


def _config() -> ClientConfig:
    here = Path("kit")
    return ClientConfig(
        path=here / "client.toml",
        site_id=SITE,
        federation_id=FED,
        server_address="localhost:0",
        role="participant",
        state_dir=here / "state",
        tls=TlsPaths(here / "ca.pem", here / "cert.pem", here / "key.pem"),
        identity_key_path=here / "identity.pem",
        identity_public_key=b"\x01" * 32,
        server_public_key=SERVER_KEY,
        peers={},
        data=DataConfig(cache=here / "cache"),
    )


def _enrolment(server_key: bytes = SERVER_KEY) -> Answer:
    reply = pb.EnrollResponse(
        site_id=SITE, federation_id=FED, server_identity_public_key=server_key
    )
    return Answer("Enroll", b"", (reply.SerializeToString(),))


def _receipt(size: int = len(PAYLOAD), digest: bytes = DIGEST) -> Answer:
    receipt = pb.UploadReceipt(round_id="r1", release_name="gram", sha256=digest,
                               bytes_received=size)  # fmt: skip
    return Answer("Upload", b"", (receipt.SerializeToString(),))


def _uploaded() -> Session:
    """A session of an enrolled site that sent one upload with its last reply."""
    return Session(step="model", enrolled=True, sent=[("gram", DIGEST, len(PAYLOAD))])


def test_the_enrolment_reply_is_checked_and_remembered() -> None:
    session = Session(step="plan")
    check_results(ToSite(FED, (_enrolment(),)), session, _config())
    assert session.enrolled
    check_results(ToSite(FED, ()), session, _config())  # later messages carry no reply: fine


def test_an_omitted_enrolment_reply_fails() -> None:
    session = Session(step="plan")
    with pytest.raises(DaemonError, match="no reply to this site's Enroll"):
        check_results(ToSite(FED, ()), session, _config())
    assert not session.enrolled


def test_an_enrolment_reply_of_another_server_fails() -> None:
    session = Session(step="plan")
    with pytest.raises(DaemonError, match="identity key differs"):
        check_results(ToSite(FED, (_enrolment(b"\x02" * 32),)), session, _config())
    assert not session.enrolled


def test_a_matching_receipt_passes() -> None:
    session = _uploaded()
    check_results(ToSite(FED, (_receipt(),)), session, _config())
    assert session.sent == []


def test_omitted_upload_receipts_fail_naming_the_upload() -> None:
    with pytest.raises(UploadError, match="upload gram: the coordinator's message carries no"):
        check_results(ToSite(FED, ()), _uploaded(), _config())


@pytest.mark.parametrize(
    ("receipt", "why"),
    [(_receipt(size=3), "3 bytes received of"), (_receipt(digest=b"\x00" * 32), "differs")],
)
def test_a_receipt_for_other_bytes_fails(receipt: Answer, why: str) -> None:
    with pytest.raises(UploadError, match=why):
        check_results(ToSite(FED, (receipt,)), _uploaded(), _config())


def test_a_receipt_for_nothing_sent_fails() -> None:
    session = Session(step="model", enrolled=True)
    with pytest.raises(UploadError, match="did not send"):
        check_results(ToSite(FED, (_receipt(),)), session, _config())


def test_a_refused_upload_is_raised_as_the_refusal() -> None:
    refused = Answer("Upload", b"", error="ALREADY_EXISTS: another payload is stored")
    with pytest.raises(RemoteCallError, match="another payload is stored") as caught:
        check_results(ToSite(FED, (refused,)), _uploaded(), _config())
    assert not isinstance(caught.value, UploadError)
