"""The CKKS decryptor site's job handling (docs/protocol.md §4.3): it decrypts only planned
releases, each once (also across a restart), and only sums whose tag slots equal the members'
secret tags, counting only tags each member signed. A server that forwards a single site's
ciphertext as a "sum" (a forged decryption job), with or without tags it sealed itself "from"
the other members, is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import threading
from typing import Any

import numpy as np
import pytest

from afl.client.config import ClientConfig, DataConfig, TlsPaths
from afl.client.daemon.decryptor import (
    DecryptionLedger,
    DecryptorDaemon,
    DecryptorKeys,
    RoundDecryptor,
    load_or_create_keys,
)
from afl.client.daemon.opening import never_decrypted, undecrypted_aborts
from afl.client.daemon.transparency import LogWitness, SplitViewDetected
from afl.client.daemon.transport import DaemonError
from afl.core.influence import InfluenceBound
from afl.crypto import aead, kdf
from afl.crypto.canonical import DOMAIN_TAG
from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.wire import (
    DECRYPTION_CONTEXT,
    PURPOSE_CKKS_TAGS,
    TagBinding,
    decryption_fields,
    seal_tags,
)
from afl.crypto.errors import CryptoError
from afl.crypto.identity import pki, signatures
from afl.crypto.identity.revocation import PeerRevocations, issue_crl
from afl.crypto.transparency.statements import decode_statement, roster_digest
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.modes.ckks import CkksMode
from afl.server.plan.release import build_plan, round1_releases, sign_plan
from tests.helpers.fedlog import LOG_RPCS, LogService, site_witness

SITES = ("site-1", "site-2", "site-3")
D = 6
BOUND = 50.0
IDENTITIES = {s: signatures.generate_identity_key() for s in SITES}
PEERS = {s: signatures.public_key_to_raw(k) for s, k in IDENTITIES.items()}
DECRYPTOR = signatures.generate_identity_key()
#: The decryptor's kit roster ([peers] and itself), whose digest every plan here binds.
ROSTER = {**PEERS, "decryptor": signatures.public_key_to_raw(DECRYPTOR)}


@pytest.fixture(scope="module")
def keys(private_ctx: Any) -> DecryptorKeys:
    return DecryptorKeys(private_ctx, kdf.generate_agreement_key())


def _signed_plan(
    server_key: Any,
    *,
    mode: int = cpb.AGGREGATION_MODE_CKKS,
    roster: dict[str, bytes] = ROSTER,
) -> Any:
    releases = round1_releases(
        classes=["A"], participants=SITES, coverage={}, gram_scope="global", d=D,
        need_global_gram=False,
    )  # fmt: skip
    ckks_options = CkksMode(gram_bound=BOUND, vector_bound=BOUND).plan_options(SITES)
    options = dataclasses.replace(ckks_options, aggregation=mode)
    plan = build_plan(
        federation_id="fed", round_id="r1-x", round_number=1, participants=SITES,
        gram_scope="global", releases=releases, options=options,
    )  # fmt: skip
    plan.roster_sha256 = roster_digest(federation="fed", keys=roster)
    return sign_plan(plan, server_key)


class Federation:
    """Three sites' tags and ciphertexts for every release of one signed CKKS plan."""

    def __init__(self, keys: DecryptorKeys, *, roster: dict[str, bytes] = ROSTER) -> None:
        self.server_key = signatures.generate_identity_key()
        self.signed = _signed_plan(self.server_key, roster=roster)
        self.plan = cpb.ReleasePlan.FromString(self.signed.plan)
        self.public = ckks.load_public_context(keys.public_context)
        rng = np.random.default_rng(3)
        self.values: dict[tuple[str, str], Any] = {}
        self.uploads: dict[tuple[str, str], list[Any]] = {}
        self.sealed = []
        self.tags: dict[str, dict[str, float]] = {}
        for site in SITES:
            tags = {r.name: ckks.new_tag(num_summands=len(SITES)) for r in self.plan.releases}
            for r in self.plan.releases:
                n = D * (D + 1) // 2 if r.encoding.packing == cpb.PACKING_UPPER_TRIANGLE else D
                x = rng.uniform(-BOUND, BOUND, size=n)
                self.values[(site, r.name)] = x
                self.uploads[(site, r.name)] = ckks.encrypt_block(
                    self.public, x, prescale=r.encoding.ckks.prescale,
                    num_summands=len(SITES), tag=tags[r.name],
                )  # fmt: skip
            self.tags[site] = tags
            message = pb.AggregateTags(
                round_id=self.plan.round_id, site_id=site,
                tags=[pb.TagValue(upload_name=n, value=v) for n, v in tags.items()],
            )  # fmt: skip
            sealed = seal_tags(
                message.SerializeToString(), binding=self.binding(keys, site),
                identity_key=IDENTITIES[site],
            )  # fmt: skip
            self.sealed.append(
                pb.SealedMessage(
                    sender_site_id=site, sender_public_key=sealed.ephemeral_public_key,
                    ciphertext=sealed.blob, signature=sealed.signature,
                )
            )  # fmt: skip

    def binding(self, keys: DecryptorKeys, site: str) -> TagBinding:
        return TagBinding(
            federation_id="fed", round_id=self.plan.round_id, round_salt=self.plan.round_salt,
            plan_sha256=hashlib.sha256(self.signed.plan).digest(), sender=site,
            recipient="decryptor", recipient_key=keys.cipher_public_key,
        )  # fmt: skip

    def decryptor(
        self,
        keys: DecryptorKeys,
        sealed: list[pb.SealedMessage] | None = None,
        ledger: DecryptionLedger | None = None,
    ) -> RoundDecryptor:
        work = RoundDecryptor(
            keys, self.signed, site_id="decryptor",
            server_key=signatures.public_key_to_raw(self.server_key), federation_id="fed",
            peers=PEERS, roster=ROSTER, ledger=ledger,
        )  # fmt: skip
        for message in self.sealed if sealed is None else sealed:
            with contextlib.suppress(CryptoError):  # the daemon logs and ignores the envelope
                work.add_tags(message)
        return work

    def aggregate(self, release: str, members: tuple[str, ...] = SITES) -> bytes:
        length = self.values[(SITES[0], release)].size
        total = ckks.sum_ciphertexts(
            self.public, [self.uploads[(s, release)] for s in members], length=length
        )
        return ckks.pack_ciphertexts(ckks.serialize_ciphertexts(total))


def _job(name: str, data: bytes, members: tuple[str, ...] = SITES) -> pb.DecryptionJob:
    return pb.DecryptionJob(
        release_name=name,
        member_site_ids=list(members),
        ciphertext_sha256=hashlib.sha256(data).digest(),
        size_bytes=len(data),
    )


def test_honest_job_is_decrypted_to_the_grid_within_the_error_bound(keys: DecryptorKeys) -> None:
    fed = Federation(keys)
    work = fed.decryptor(keys)
    data = fed.aggregate("b[A]")
    status, reason, result = work.decrypt(_job("b[A]", data), data)
    assert status == pb.DECRYPTION_STATUS_DECRYPTED, reason
    values = np.frombuffer(result, dtype="<f8")
    exact = np.sum([fed.values[(s, "b[A]")] for s in SITES], axis=0)
    enc = next(r for r in fed.plan.releases if r.name == "b[A]").encoding.ckks
    bound = cp.error_bound(prescale=enc.prescale, num_summands=3, grid=enc.grid_step)
    assert np.max(np.abs(values - exact)) <= bound
    assert np.all(np.round(values / enc.grid_step) * enc.grid_step == values)  # on the grid
    # The same aggregate again (a retry): the same bytes; another aggregate: refused.
    assert work.decrypt(_job("b[A]", data), data) == (status, reason, result)
    pair = fed.aggregate("b[A]", members=SITES[:2])
    assert (
        work.decrypt(_job("b[A]", pair), pair)[0] == pb.DECRYPTION_STATUS_REFUSED_ALREADY_DECRYPTED
    )


def test_forged_job_with_one_sites_ciphertext_is_refused(keys: DecryptorKeys) -> None:
    fed = Federation(keys)
    work = fed.decryptor(keys)
    single = fed.aggregate("gram[all]", members=("site-1",))  # the server forwards c_1 alone
    status, reason, result = work.decrypt(_job("gram[all]", single), single)
    assert status == pb.DECRYPTION_STATUS_REFUSED_TAG_MISMATCH and result == b""
    assert "tag" in reason
    # The secret key was applied once: the release is spent, the honest sum is refused too.
    honest = fed.aggregate("gram[all]")
    assert work.decrypt(_job("gram[all]", honest), honest)[0] == (
        pb.DECRYPTION_STATUS_REFUSED_ALREADY_DECRYPTED
    )


def _forged_envelope(keys: DecryptorKeys, fed: Federation, site: str, value: float) -> Any:
    """Tags "from" ``site`` sealed by the coordinator itself (it knows the decryptor's public
    tag key and the plan), signed with its own key: what a malicious coordinator can make."""
    message = pb.AggregateTags(
        round_id=fed.plan.round_id,
        site_id=site,
        tags=[pb.TagValue(upload_name=r.name, value=value) for r in fed.plan.releases],
    )
    binding = fed.binding(keys, site)
    sealed = seal_tags(message.SerializeToString(), binding=binding, identity_key=fed.server_key)
    return pb.SealedMessage(
        sender_site_id=site,
        sender_public_key=sealed.ephemeral_public_key,
        ciphertext=sealed.blob,
        signature=sealed.signature,
    )


def _unsigned_envelope(keys: DecryptorKeys, fed: Federation, site: str, value: float) -> Any:
    """The same, sealed the way tags travelled before they were signed (no signature)."""
    message = pb.AggregateTags(
        round_id=fed.plan.round_id,
        site_id=site,
        tags=[pb.TagValue(upload_name=r.name, value=value) for r in fed.plan.releases],
    )
    ephemeral = kdf.generate_agreement_key()
    key = kdf.derive_key(
        shared_secret=kdf.agree(ephemeral, keys.cipher_public_key),
        round_salt=fed.plan.round_salt,
        purpose=PURPOSE_CKKS_TAGS,
        round_id=fed.plan.round_id,
        release="",
        binding=(site, "decryptor"),
    )
    blob = aead.seal(
        key,
        message.SerializeToString(),
        associated=(DOMAIN_TAG, PURPOSE_CKKS_TAGS, site, "decryptor", fed.plan.round_id),
    )
    return pb.SealedMessage(
        sender_site_id=site, sender_public_key=kdf.public_key_bytes(ephemeral), ciphertext=blob
    )


@pytest.mark.parametrize("forge", [_forged_envelope, _unsigned_envelope])
def test_tags_sealed_by_the_coordinator_for_other_members_are_refused(
    keys: DecryptorKeys, forge: Any
) -> None:
    # The attack: c_1 alone as the sum of {1, 2, 3}, and tags +1000 / -1000 "from" sites 2 and
    # 3 sealed by the coordinator, so that the tag sum is r_1 (the tag slot of c_1).
    fed = Federation(keys)
    forged = [
        fed.sealed[0],
        forge(keys, fed, "site-2", 1000.0),
        forge(keys, fed, "site-3", -1000.0),
    ]
    work = fed.decryptor(keys, sealed=forged)
    assert work.senders == {"site-1"}  # the forged envelopes did not open
    single = fed.aggregate("gram[all]", members=("site-1",))
    status, reason, result = work.decrypt(_job("gram[all]", single), single)
    assert status == pb.DECRYPTION_STATUS_REFUSED_TAG_MISMATCH and result == b""
    assert "no valid tag from ['site-2', 'site-3']" in reason
    # Refused before the secret key was applied: the honest sum with honest tags still decrypts.
    honest = fed.aggregate("gram[all]")
    for sealed in fed.sealed[1:]:
        work.add_tags(sealed)
    assert work.decrypt(_job("gram[all]", honest), honest)[0] == pb.DECRYPTION_STATUS_DECRYPTED


def test_tags_bound_to_another_round_plan_or_decryptor_key_do_not_open(
    keys: DecryptorKeys,
) -> None:
    fed = Federation(keys)
    message = pb.AggregateTags(round_id=fed.plan.round_id, site_id="site-2")
    honest = fed.binding(keys, "site-2")
    for change in (
        {"plan_sha256": b"\x01" * 32},
        {"federation_id": "other"},
        {"recipient_key": kdf.public_key_bytes(kdf.generate_agreement_key())},
    ):
        other = dataclasses.replace(honest, **change)
        sealed = seal_tags(
            message.SerializeToString(), binding=other, identity_key=IDENTITIES["site-2"]
        )
        envelope = pb.SealedMessage(
            sender_site_id="site-2",
            sender_public_key=sealed.ephemeral_public_key,
            ciphertext=sealed.blob,
            signature=sealed.signature,
        )
        work = fed.decryptor(keys, sealed=[envelope])
        assert work.senders == set(), change


def test_decrypt_once_survives_a_restart(keys: DecryptorKeys, tmp_path: Any) -> None:
    fed = Federation(keys)
    data = fed.aggregate("b[A]")
    first = fed.decryptor(keys, ledger=DecryptionLedger(tmp_path))
    assert first.decrypt(_job("b[A]", data), data)[0] == pb.DECRYPTION_STATUS_DECRYPTED
    record = tmp_path / "decrypted.json"
    assert record.stat().st_mode & 0o777 == 0o600
    # A new process (new ledger from the same folder, new round state) decrypts the same
    # aggregate again (a retry reveals nothing new) and refuses any other under that name.
    restarted = fed.decryptor(keys, ledger=DecryptionLedger(tmp_path))
    assert restarted.decrypt(_job("b[A]", data), data)[0] == pb.DECRYPTION_STATUS_DECRYPTED
    other = fed.aggregate("b[A]", members=("site-1", "site-2"))
    status, reason, result = restarted.decrypt(_job("b[A]", other), other)
    assert status == pb.DECRYPTION_STATUS_REFUSED_ALREADY_DECRYPTED and result == b""
    assert "already decrypted" in reason
    # Other releases of the round are untouched.
    gram = fed.aggregate("gram[all]")
    assert restarted.decrypt(_job("gram[all]", gram), gram)[0] == pb.DECRYPTION_STATUS_DECRYPTED


def test_the_record_is_written_before_the_secret_key_is_applied(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    fed = Federation(keys)
    data = fed.aggregate("b[A]")
    ledger = DecryptionLedger(tmp_path)
    (tmp_path / "decrypted.json").mkdir()  # the record cannot be written: no decryption
    work = fed.decryptor(keys, ledger=ledger)
    with pytest.raises(DaemonError, match="cannot record the decryption"):
        work.decrypt(_job("b[A]", data), data)


def test_jobs_outside_the_plan_are_refused_before_decrypting(keys: DecryptorKeys) -> None:
    fed = Federation(keys)
    work = fed.decryptor(keys)
    pair = fed.aggregate("b[A]", members=("site-1", "site-2"))
    assert work.decrypt(_job("b[A]", pair, ("site-1", "site-2")), pair)[0] == (
        pb.DECRYPTION_STATUS_REFUSED_NOT_IN_PLAN
    )
    assert work.decrypt(_job("gram{site-1}", pair), pair)[0] == (
        pb.DECRYPTION_STATUS_REFUSED_NOT_IN_PLAN
    )
    data = fed.aggregate("b[A]")
    wrong_digest = _job("b[A]", data + b"x")
    assert work.decrypt(wrong_digest, data)[0] == pb.DECRYPTION_STATUS_REFUSED_MALFORMED
    # None of these consumed the release.
    assert work.decrypt(_job("b[A]", data), data)[0] == pb.DECRYPTION_STATUS_DECRYPTED


def test_plan_must_be_signed_by_the_kits_server_and_in_ckks_mode(keys: DecryptorKeys) -> None:
    fed = Federation(keys)
    other = signatures.public_key_to_raw(signatures.generate_identity_key())
    with pytest.raises(DaemonError, match="not signed by this federation's server"):
        RoundDecryptor(
            keys, fed.signed, site_id="decryptor", server_key=other, federation_id="fed",
            peers=PEERS, roster=ROSTER,
        )  # fmt: skip
    plaintext = _signed_plan(fed.server_key, mode=cpb.AGGREGATION_MODE_PLAINTEXT)
    with pytest.raises(DaemonError, match="not a CKKS plan"):
        RoundDecryptor(
            keys, plaintext, site_id="decryptor",
            server_key=signatures.public_key_to_raw(fed.server_key), federation_id="fed",
            peers=PEERS, roster=ROSTER,
        )  # fmt: skip


def test_keys_are_created_once_and_kept_private(tmp_path: Any) -> None:
    first = load_or_create_keys(tmp_path)
    second = load_or_create_keys(tmp_path)
    assert first.public_context == second.public_context
    assert first.cipher_public_key == second.cipher_public_key
    for path in (tmp_path / "ckks").iterdir():
        assert path.stat().st_mode & 0o777 == 0o600
    assert not ckks.load_public_context(first.public_context).is_private()


class _Coordinator:
    """What a DecryptorDaemon's RPC client returns: the current ``jobs`` (any round id the
    coordinator likes, with the signed plan), the sealed tags when ``tags`` is set, ``data`` as
    the aggregate of every job; outcomes and results are recorded. The federation log is a real
    one (:class:`tests.helpers.fedlog.LogService`) holding the plan, in which the three sites
    witness each checkpoint that holds the decryptor's `decrypting` statement."""

    def __init__(self, fed: Federation, tmp_path: Any) -> None:
        self.fed = fed
        self.jobs = pb.DecryptionJobs()
        self.tags = False
        self.data = b""
        self.outcomes: list[tuple[pb.DecryptionOutcome, bytes]] = []
        self.log = LogService(tmp_path / "coordinator", key=fed.server_key, federation_id="fed")
        self.log.caller = "decryptor"
        self.log.enrol("decryptor", ROSTER["decryptor"], role="decryptor")
        keys = {**IDENTITIES, "decryptor": DECRYPTOR}
        self.witnesses = []
        for site in SITES:
            self.log.enrol(site, PEERS[site])
            folder = tmp_path / "witnesses" / site
            folder.mkdir(parents=True)
            self.witnesses.append(
                site_witness(
                    folder, federation="fed", site=site, keys=keys, coordinator=fed.server_key
                )
            )
        digest = self.log.publish_plan(fed.plan.round_id, fed.signed.plan)
        self.log.solving = lambda round_id: digest if round_id == fed.plan.round_id else b""

    def serve(self, round_id: str, data: bytes, *, tags: bool) -> None:
        self.jobs = pb.DecryptionJobs(
            round_id=round_id, release_plan=self.fed.signed, jobs=[_job("b[A]", data)]
        )
        self.data, self.tags = data, tags

    def call(self, what: str, request: Any, **kw: Any) -> Any:
        if what in LOG_RPCS:
            answer = self.log.call(what, request)
            if what == "RecordDecrypting":  # the sites witness the checkpoint that holds it
                for witness in self.witnesses:
                    witness.witness(self.log.call)
            return answer
        if what == "GetDecryptionJobs":
            return self.jobs
        if what == "GetAggregateTags":
            return pb.SealedMessages(messages=self.fed.sealed if self.tags else [])
        assert what == "ReportDecryption", what
        self.outcomes.append((request, self.data))
        return cpb.Ack()

    def download(self, request: pb.DownloadRequest) -> bytes:
        return self.data

    def upload(self, data: bytes, **kw: Any) -> Any:
        return pb.UploadReceipt()


def _daemon(keys: DecryptorKeys, fed: Federation, tmp_path: Any) -> tuple[Any, _Coordinator]:
    """A decryptor daemon (identity DECRYPTOR, the kit's peers) talking to ``_Coordinator``."""
    key_path = tmp_path / "identity.key"
    key_path.write_bytes(signatures.private_key_to_pem(DECRYPTOR))
    config = ClientConfig(
        path=tmp_path / "client.toml", site_id="decryptor", federation_id="fed",
        server_address="localhost:1", role="decryptor", state_dir=tmp_path / "state",
        tls=TlsPaths(tmp_path, tmp_path, tmp_path), identity_key_path=key_path,
        identity_public_key=signatures.public_key_to_raw(DECRYPTOR),
        server_public_key=signatures.public_key_to_raw(fed.server_key), peers=PEERS,
        data=DataConfig(tmp_path),
    )  # fmt: skip
    daemon = DecryptorDaemon(config)
    daemon.keys = keys
    coordinator = _Coordinator(fed, tmp_path)
    daemon.rpc = coordinator  # type: ignore[assignment]
    return daemon, coordinator


def test_one_release_is_decrypted_for_one_aggregate_whatever_round_id_the_jobs_name(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """The coordinator lists the jobs of plan round r1-x under two round ids of its choosing.
    Without tags the jobs are refused and bind nothing, but the decryptor keeps a round state per
    listed id, each holding the decrypt-once record as it was then; with tags, each would then
    decrypt another aggregate of b[A] (docs/protocol.md M-111)."""
    fed = Federation(keys)
    honest = fed.aggregate("b[A]")
    length = fed.values[(SITES[0], "b[A]")].size
    vectors = ckks.deserialize_ciphertexts(
        fed.public, ckks.unpack_ciphertexts(honest), length=length
    )
    # The coordinator adds a fresh encryption of zeros: the same tags and values, other bytes.
    zero = ckks.encrypt_block(fed.public, np.zeros(length), prescale=1.0, num_summands=3, tag=0.0)
    other = ckks.pack_ciphertexts(ckks.serialize_ciphertexts([vectors[0] + zero[0]]))
    identity = DECRYPTOR
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    for round_id, data, tags in (
        ("r1-x", honest, False), ("r9-y", other, False), ("r1-x", honest, True),
        ("r9-y", other, True),
    ):  # fmt: skip
        coordinator.serve(round_id, data, tags=tags)
        with contextlib.suppress(DaemonError):  # run() logs it and polls again
            daemon.serve_once()
    decrypted = {
        hashlib.sha256(data).hexdigest()
        for outcome, data in coordinator.outcomes
        if outcome.status == pb.DECRYPTION_STATUS_DECRYPTED
    }
    assert len(decrypted) == 1
    # Each signed outcome binds the federation, the round and the plan's digest.
    assert coordinator.outcomes
    for outcome, _ in coordinator.outcomes:
        fields: dict[str, Any] = {
            "federation_id": "fed", "round_id": outcome.round_id,
            "plan_sha256": hashlib.sha256(fed.signed.plan).digest(),
            "release_name": outcome.release_name, "status": outcome.status,
            "result_sha256": outcome.result_sha256,
        }  # fmt: skip
        signatures.verify_fields(
            identity.public_key(), outcome.signature, context=DECRYPTION_CONTEXT,
            fields=decryption_fields(**fields),
        )  # fmt: skip
        wrong: list[dict[str, Any]] = [{"federation_id": "other"}, {"plan_sha256": b"\x01" * 32}]
        for binding in wrong:
            with pytest.raises(CryptoError):
                signatures.verify_fields(
                    identity.public_key(), outcome.signature, context=DECRYPTION_CONTEXT,
                    fields=decryption_fields(**(fields | binding)),
                )  # fmt: skip


def test_tags_a_member_signed_over_bytes_that_do_not_parse_are_refused_in_one_line(
    keys: DecryptorKeys,
) -> None:
    """A member seals and signs, with its own key, bytes that are no AggregateTags message: the
    decryptor refuses that envelope (a CryptoError its loop logs) instead of stopping with a
    traceback at every poll (one site would stall every CKKS round)."""
    fed = Federation(keys)
    sealed = seal_tags(
        b"\xff\xff\xff\xff", binding=fed.binding(keys, "site-1"), identity_key=IDENTITIES["site-1"]
    )
    envelope = pb.SealedMessage(
        sender_site_id="site-1", sender_public_key=sealed.ephemeral_public_key,
        ciphertext=sealed.blob, signature=sealed.signature,
    )  # fmt: skip
    work = fed.decryptor(keys, sealed=[])
    with pytest.raises(CryptoError, match="AggregateTags"):
        work.add_tags(envelope)
    assert work.senders == set()


def test_a_sum_no_members_datasets_could_produce_is_not_returned(keys: DecryptorKeys) -> None:
    """Bounded influence in ckks (docs/protocol.md §6.2, M-134): the decryptor sees only sums,
    and refuses to return one outside what m datasets within its [policy] decrypt_max_rows and
    decrypt_max_row_norm could produce (‖Σ b_c‖ ≤ m·2L, trace(Σ G) ≤ m·N·L²), naming the bound."""
    fed = Federation(keys)
    vector = next(r for r in fed.plan.releases if r.kind == cpb.STATISTIC_KIND_CLASS_VECTOR)
    data = fed.aggregate(vector.name)
    summed = sum(fed.values[(s, vector.name)] for s in SITES)
    norm = float(np.linalg.norm(summed))
    # L such that 3 members' 2L sit just above, then just below, the sum's norm
    for factor, expected in ((1.01, pb.DECRYPTION_STATUS_DECRYPTED), (0.9, None)):
        work = fed.decryptor(keys)
        work.site_bound = InfluenceBound.of_dataset(
            rows=10**6, max_row_norm=factor * norm / (2 * len(SITES))
        )
        status, reason, values = work.decrypt(_job(vector.name, data), data)
        if expected is not None:
            assert status == expected and values, reason
            continue
        assert status == pb.DECRYPTION_STATUS_REFUSED_OUT_OF_BOUND and values == b""
        assert "class vector norm above 2L" in reason and "decrypt_max_row_norm" in reason
    gram = next(r for r in fed.plan.releases if r.kind == cpb.STATISTIC_KIND_GRAM)
    data = fed.aggregate(gram.name)
    work = fed.decryptor(keys)
    work.site_bound = InfluenceBound.of_dataset(rows=1, max_row_norm=1.0)
    status, reason, values = work.decrypt(_job(gram.name, data), data)
    assert status == pb.DECRYPTION_STATUS_REFUSED_OUT_OF_BOUND and values == b""
    assert "Gram" in reason


def test_a_plan_binding_another_roster_is_refused_before_any_key_is_used(
    keys: DecryptorKeys,
) -> None:
    """M-224: the decryptor checks the plan's roster digest against its own kit's roster
    ([peers] and itself) as the sites do: a plan the coordinator signed over a roster in which
    site-2's identity key is another (the operator's) is refused in one line, and so is a plan
    binding no roster."""
    swapped = {**ROSTER, "site-2": signatures.public_key_to_raw(signatures.generate_identity_key())}
    for roster, reason in ((swapped, "binds roster"), ({}, "binds no roster digest")):
        fed = Federation(keys, roster=roster) if roster else Federation(keys)
        signed = fed.signed
        if not roster:
            plan = cpb.ReleasePlan.FromString(signed.plan)
            plan.ClearField("roster_sha256")
            signed = sign_plan(plan, fed.server_key)
        with pytest.raises(DaemonError, match=f"refuses round r1-x: the plan .*{reason}") as raised:
            RoundDecryptor(
                keys, signed, site_id="decryptor",
                server_key=signatures.public_key_to_raw(fed.server_key), federation_id="fed",
                peers=PEERS, roster=ROSTER,
            )  # fmt: skip
        assert "\n" not in str(raised.value)
    assert fed.decryptor(keys).plan.round_id == "r1-x"  # the kit's own roster: accepted


def test_a_plan_naming_a_revoked_participant_is_refused(keys: DecryptorKeys, tmp_path: Any) -> None:
    """M-224: with ``[tls] crl`` the decryptor refuses a plan one of whose participants has an
    identity key the federation CA revoked (the sites' check, M-178), naming the peer, and every
    plan while the list is not the CA's (fail closed)."""
    fed = Federation(keys)
    ca = pki.create_ca(common_name="afl federation CA decryptor test")
    path = tmp_path / "crl.pem"
    revocations = PeerRevocations(path, ca_certificate_pem=ca.certificate_pem())

    def build() -> RoundDecryptor:
        return RoundDecryptor(
            keys, fed.signed, site_id="decryptor",
            server_key=signatures.public_key_to_raw(fed.server_key), federation_id="fed",
            peers=PEERS, roster=ROSTER, revocations=revocations,
        )  # fmt: skip

    path.write_bytes(issue_crl(ca, revoked={}))
    assert build().plan.round_id == "r1-x"  # nobody revoked
    when = dt.datetime(2026, 5, 6, 7, 8, 9, tzinfo=dt.UTC)
    path.write_bytes(issue_crl(ca, revoked={5: when}, peers={5: ("site-3", PEERS["site-3"])}))
    with pytest.raises(DaemonError, match="refuses round r1-x: peer 'site-3' is revoked") as raised:
        build()
    assert "\n" not in str(raised.value) and PEERS["site-3"].hex()[:16] in str(raised.value)
    impostor = pki.create_ca(common_name="afl federation CA decryptor test")
    path.write_bytes(issue_crl(impostor, revoked={}))
    with pytest.raises(DaemonError, match="peer revocation status unknown"):
        build()


def test_a_refused_plan_is_reported_to_the_coordinator_as_a_signed_refusal(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """A job whose plan the decryptor refuses (here: it binds a roster in which site-2's key is
    another) is answered at once with a ``REFUSED_PLAN`` outcome naming why, signed over the
    plan the job carries, so the coordinator aborts the round with the reason instead of waiting
    for its deadline; nothing is downloaded and no key is used (M-224)."""
    swapped = {**ROSTER, "site-2": signatures.public_key_to_raw(signatures.generate_identity_key())}
    fed = Federation(keys, roster=swapped)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    downloads: list[pb.DownloadRequest] = []
    coordinator.download = downloads.append  # type: ignore[assignment,method-assign]
    coordinator.serve("r1-x", b"unused", tags=True)
    assert daemon.serve_once() == 1
    ((outcome, _),) = coordinator.outcomes
    assert outcome.status == pb.DECRYPTION_STATUS_REFUSED_PLAN
    assert "refuses round r1-x: the plan" in outcome.reason and "binds roster" in outcome.reason
    assert outcome.result_sha256 == b"" and downloads == []
    signatures.verify_fields(
        DECRYPTOR.public_key(), outcome.signature, context=DECRYPTION_CONTEXT,
        fields=decryption_fields(
            federation_id="fed", round_id="r1-x", plan_sha256=hashlib.sha256(fed.signed.plan).digest(),
            release_name="b[A]", status=pb.DECRYPTION_STATUS_REFUSED_PLAN, result_sha256=b"",
        ),
    )  # fmt: skip
    assert not (tmp_path / "state" / "ckks" / "decrypted.json").exists()  # no key applied
    assert daemon.serve_once() == 0 and len(coordinator.outcomes) == 1  # reported once


def test_a_rounds_jobs_are_served_together_and_each_is_decrypted_once(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """The jobs of a round run on two workers: the first job's download is held until another
    job has reported its outcome (which a one-job-at-a-time decryptor never gets to), and every
    release still gets exactly one signed outcome, its result and one decrypt-once record."""
    fed = Federation(keys)
    names = [r.name for r in fed.plan.releases]
    aggregates = {name: fed.aggregate(name) for name in names}
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    coordinator.jobs = pb.DecryptionJobs(
        round_id=fed.plan.round_id,
        release_plan=fed.signed,
        jobs=[_job(name, aggregates[name]) for name in names],
    )
    coordinator.tags = True
    reported, held = threading.Event(), []

    def download(request: pb.DownloadRequest) -> bytes:
        if request.release_name == names[0]:
            held.append(reported.wait(timeout=120))  # generous: no timing is asserted
        return aggregates[request.release_name]

    def call(what: str, request: Any, **kw: Any) -> Any:
        if what == "ReportDecryption":
            coordinator.outcomes.append((request, aggregates[request.release_name]))
            reported.set()
            return cpb.Ack()
        return _Coordinator.call(coordinator, what, request, **kw)

    coordinator.download = download  # type: ignore[method-assign]
    coordinator.call = call  # type: ignore[method-assign]
    assert daemon.serve_once() == len(names) >= 2
    assert held == [True]  # another job reported while the first one's download was held
    outcomes = {o.release_name: o for o, _ in coordinator.outcomes}
    assert sorted(outcomes) == sorted(names) and len(coordinator.outcomes) == len(names)
    assert all(o.status == pb.DECRYPTION_STATUS_DECRYPTED for o in outcomes.values())
    ledger = DecryptionLedger(tmp_path / "state" / "ckks").used(fed.plan.round_id)
    assert sorted(ledger) == sorted(names)
    records = (tmp_path / "state" / "ckks" / "decryptions.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["release"] for line in records) == sorted(names)


def test_the_decrypting_statement_is_in_a_quorum_checkpoint_before_the_key_touches_a_sum(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """M-235: the decryptor logs its signed `decrypting` statement of the round, waits until a
    checkpoint cosigned by a quorum of the roster holds it, and only then decrypts (the
    decrypt-once record, written before the key is applied, comes after it). A second poll of
    the same round logs nothing again."""
    fed = Federation(keys)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    ledger = tmp_path / "state" / "ckks" / "decrypted.json"
    seen: list[tuple[str, bool]] = []
    plain = coordinator.call

    def call(what: str, request: Any, **kw: Any) -> Any:
        seen.append((what, ledger.exists()))
        return plain(what, request, **kw)

    coordinator.call = call  # type: ignore[method-assign]
    coordinator.serve(fed.plan.round_id, fed.aggregate("b[A]"), tags=True)
    assert daemon.serve_once() == 1
    assert [o.status for o, _ in coordinator.outcomes] == [pb.DECRYPTION_STATUS_DECRYPTED]
    assert ("RecordDecrypting", False) in seen  # before the decrypt-once record
    entries = coordinator.log.store.log_entries(0, coordinator.log.store.log_size())
    statements = [decode_statement(e, federation="fed") for _, _, e, _ in entries]
    decrypting = [f for kind, f in statements if kind == "decrypting"]
    assert len(decrypting) == 1 and decrypting[0]["round_id"] == fed.plan.round_id
    cosigners = {c.witness for c in coordinator.log.log.checkpoint().cosignatures}
    assert len(cosigners) >= 3  # a majority of the four-party roster
    seen.clear()
    coordinator.serve(fed.plan.round_id, fed.aggregate("b[A]"), tags=True)
    daemon.serve_once()
    assert "RecordDecrypting" not in [what for what, _ in seen]


def test_a_round_the_log_records_as_aborted_is_not_decrypted(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """M-235: a coordinator that logged the round's abort (so that every site's audit counts the
    round as never released) and then hands out its sums gets a signed refusal; the key touches
    nothing. Its `decrypting` statement is logged all the same (after the abort), so the round
    would count as released if it had been decrypted."""
    fed = Federation(keys)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    coordinator.log.store.append_log(
        "round-aborted", {"round_id": fed.plan.round_id, "reason": "a site was lost"}
    )
    coordinator.serve(fed.plan.round_id, fed.aggregate("b[A]"), tags=True)
    assert daemon.serve_once() == 1
    [(outcome, _)] = coordinator.outcomes
    assert outcome.status == pb.DECRYPTION_STATUS_REFUSED_PLAN
    assert "records round r1-x as aborted before this decryptor's decrypting statement" in (
        outcome.reason
    )
    assert not (tmp_path / "state" / "ckks" / "decrypted.json").exists()  # no key applied


def test_a_coordinator_that_does_not_log_the_decrypting_statement_gets_nothing_decrypted(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """The coordinator answers RecordDecrypting but appends nothing: the decryptor's quorum wait
    finds no inclusion proof and it decrypts nothing (its run loop polls again)."""
    fed = Federation(keys)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    daemon.config = dataclasses.replace(
        daemon.config,
        timing=dataclasses.replace(daemon.config.timing, upload_timeout_s=0.2),
    )
    plain = coordinator.call

    def call(what: str, request: Any, **kw: Any) -> Any:
        if what == "RecordDecrypting":
            return pb.LogProof(index=0)
        return plain(what, request, **kw)

    coordinator.call = call  # type: ignore[method-assign]
    coordinator.serve(fed.plan.round_id, fed.aggregate("b[A]"), tags=True)
    with pytest.raises(DaemonError, match=r"decrypting statement of round r1-x.*nothing decrypted"):
        daemon.serve_once()
    assert coordinator.outcomes == []
    assert not (tmp_path / "state" / "ckks" / "decrypted.json").exists()


def _restored_copy(coordinator: _Coordinator, fed: Federation, folder: Any) -> LogService:
    """The coordinator's log as a backup taken while the round's plan was its last statement
    (the same enrolments and plan, so the same entries and root): what an acknowledged restore
    (M-142) puts back."""
    copy = LogService(folder, key=fed.server_key, federation_id="fed")
    copy.caller = "decryptor"
    copy.enrol("decryptor", ROSTER["decryptor"], role="decryptor")
    for site in SITES:
        copy.enrol(site, PEERS[site])
    copy.publish_plan(fed.plan.round_id, fed.signed.plan)
    copy.solving = coordinator.log.solving
    return copy


def _discounted(site: LogWitness, call: Any, answer: Any, *, wait_s: float = 0.3) -> set[str]:
    """The CKKS rounds ``site``'s whole-history audit counts as never decrypted at the
    checkpoint ``answer`` (as :meth:`ClientDaemon._never_decrypted` composes it): aborted, no
    `decrypting` statement, and the decryptor's cosignature on a checkpoint holding the abort
    (waited for ``wait_s``)."""
    logged = site.statements(call, answer)
    aborts = undecrypted_aborts(logged, federation="fed", decryptor="decryptor", keys=site.roster)
    if not aborts:
        return set()
    seen = site.cosigned_by(
        call, "decryptor", covering=max(aborts.values()) + 1, wait_s=wait_s, poll_s=0.01,
        max_poll_s=0.05,
    )  # fmt: skip
    return never_decrypted(aborts, seen_by_decryptor=seen)


def test_a_round_whose_abort_the_decryptor_never_cosigned_counts_and_an_acknowledged_restore_does_not_change_it(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """Review of M-235 (first version: an aborted round without a `decrypting` statement counted
    as never decrypted at once). A malicious coordinator aborts a CKKS round after its uploads
    ("a site was lost"); a quorum of the sites cosigns the log that records the abort while the
    coordinator shows the decryptor only the checkpoint before it. The sites' audits would then
    have discounted the round and accepted a re-plan without the "lost" site, and, after an
    acknowledged restore of a copy taken before the abort (M-142: the sites follow it), the
    decryptor decrypted the round: the two sums differ by the lost site's statistics. Now a
    site discounts an aborted round only once the decryptor cosigned a checkpoint that holds
    the abort: here it never did, so the round counts at every site (the re-plan is refused),
    and once the decryptor has cosigned the abort, the restored log is a split view to it and
    nothing is decrypted."""
    fed = Federation(keys)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    round_id = fed.plan.round_id
    daemon.log_witness.witness(coordinator.call)  # the decryptor's last cosigned checkpoint
    backup = _restored_copy(coordinator, fed, tmp_path / "backup")
    coordinator.log.store.append_log("round-aborted", {"round_id": round_id, "reason": "lost"})
    answers = [w.witness(coordinator.call) for w in coordinator.witnesses]
    cosigners = {c.witness for c in coordinator.log.log.checkpoint().cosignatures}
    assert cosigners == set(SITES)  # a quorum (three of the four-party roster)
    site = coordinator.witnesses[0]
    assert _discounted(site, coordinator.call, answers[0]) == set()  # the round counts
    # The decryptor cosigns the checkpoint that holds the abort: now the sites discount it...
    daemon.log_witness.witness(coordinator.call)
    assert _discounted(site, coordinator.call, answers[0]) == {round_id}
    # ... and a restore of the copy from before the abort is a split view to the decryptor.
    coordinator.log = backup
    for witness in coordinator.witnesses:
        witness.restore_acknowledged(1)
    coordinator.serve(round_id, fed.aggregate("b[A]"), tags=True)
    with pytest.raises(SplitViewDetected):
        daemon.serve_once()
    assert [o for o, _ in coordinator.outcomes] == []
    assert not (tmp_path / "state" / "ckks" / "decrypted.json").exists()


def test_a_fork_with_one_colluding_witness_does_not_let_the_sites_discount_a_round_the_decryptor_decrypts(
    keys: DecryptorKeys, tmp_path: Any
) -> None:
    """Review of M-235: a five-party roster (site-1..3 in the CKKS round, site-4 outside it, the
    decryptor), quorum 3 (the default majority). The coordinator forks its log after the round's
    plan. Fork X, shown to site-1 and site-2: the round aborted ("site-3 lost") with no
    `decrypting` statement, cosigned by site-1, site-2 and the colluding site-4. Fork Y, shown
    to the decryptor and site-3: no abort; the decryptor's `decrypting` statement is cosigned by
    the decryptor, site-3 and site-4, and it decrypts. One colluder is 2q - n for n = 5. The
    first version let site-1 and site-2 discount the round (and accept a re-plan without
    site-3); now they wait for the decryptor's cosignature on a checkpoint of their fork that
    holds the abort, which it never gives (it is on fork Y), so the round counts."""
    site4 = signatures.generate_identity_key()
    peers = {**PEERS, "site-4": signatures.public_key_to_raw(site4)}
    roster = {**peers, "decryptor": signatures.public_key_to_raw(DECRYPTOR)}
    identities = {**IDENTITIES, "site-4": site4, "decryptor": DECRYPTOR}
    fed = Federation(keys, roster=roster)
    daemon, coordinator = _daemon(keys, fed, tmp_path)
    daemon.config = dataclasses.replace(daemon.config, peers=peers)
    daemon.log_witness = LogWitness.for_site(daemon.config, daemon.identity)
    round_id = fed.plan.round_id

    def fork(name: str) -> LogService:
        log = LogService(tmp_path / name, key=fed.server_key, federation_id="fed")
        log.caller = "decryptor"
        log.enrol("decryptor", roster["decryptor"], role="decryptor")
        for site in peers:
            log.enrol(site, peers[site])
        digest = log.publish_plan(round_id, fed.signed.plan)
        log.solving = lambda r: digest if r == round_id else b""
        return log

    def witness(site: str, folder: str) -> LogWitness:
        (tmp_path / folder).mkdir()
        return site_witness(
            tmp_path / folder, federation="fed", site=site, keys=identities,
            coordinator=fed.server_key,
        )  # fmt: skip

    x, y = fork("fork-x"), fork("fork-y")
    x.store.append_log("round-aborted", {"round_id": round_id, "reason": "site-3 lost"})
    site1 = witness("site-1", "x1")
    for w in (site1, witness("site-2", "x2"), witness("site-4", "x4")):
        w.witness(x.call)
    answer = x.call("GetCheckpoint", pb.CheckpointRequest())
    assert len(site1.quorum_on(answer)) == 3  # site-1's (and site-2's) quorum holds the abort
    coordinator.log = y  # the decryptor's view; site-3 and the colluder witness it
    coordinator.witnesses = [witness("site-3", "y3"), witness("site-4", "y4")]
    coordinator.serve(round_id, fed.aggregate("b[A]"), tags=True)
    daemon.serve_once()
    decrypted = [o for o, _ in coordinator.outcomes if o.status == pb.DECRYPTION_STATUS_DECRYPTED]
    assert decrypted  # fork Y holds no abort: the decryptor decrypts
    assert _discounted(site1, x.call, answer) == set()  # so site-1's audit still counts it
