"""The CKKS decryptor site's job handling (docs/protocol.md §4.3): it decrypts only planned
releases, each once, and only sums whose tag slots equal the members' sealed secret tags. A
server that forwards a single site's ciphertext as a "sum" (a forged decryption job) is refused."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest

from afl.client.daemon_transport import DaemonError
from afl.client.decryptor import DecryptorKeys, RoundDecryptor, load_or_create_keys
from afl.crypto import ckks, kdf, signatures
from afl.crypto import ckks_params as cp
from afl.crypto.ckks_wire import seal_tags
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.mode_ckks import CkksMode
from afl.server.plan import build_plan, round1_releases, sign_plan

SITES = ("site-1", "site-2", "site-3")
D = 6
BOUND = 50.0


@pytest.fixture(scope="module")
def keys(private_ctx: Any) -> DecryptorKeys:
    return DecryptorKeys(private_ctx, kdf.generate_agreement_key())


def _signed_plan(server_key: Any, *, mode: int = cpb.AGGREGATION_MODE_CKKS) -> Any:
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
    return sign_plan(plan, server_key)


class Federation:
    """Three sites' tags and ciphertexts for every release of one signed CKKS plan."""

    def __init__(self, keys: DecryptorKeys) -> None:
        self.server_key = signatures.generate_identity_key()
        self.signed = _signed_plan(self.server_key)
        self.plan = cpb.ReleasePlan.FromString(self.signed.plan)
        self.public = ckks.load_public_context(keys.public_context)
        rng = np.random.default_rng(3)
        self.values: dict[tuple[str, str], Any] = {}
        self.uploads: dict[tuple[str, str], list[Any]] = {}
        self.sealed = []
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
            message = pb.AggregateTags(
                round_id=self.plan.round_id, site_id=site,
                tags=[pb.TagValue(upload_name=n, value=v) for n, v in tags.items()],
            )  # fmt: skip
            eph, blob = seal_tags(
                message.SerializeToString(), recipient_public_key=keys.cipher_public_key,
                round_salt=self.plan.round_salt, round_id=self.plan.round_id, sender=site,
                recipient="decryptor",
            )  # fmt: skip
            self.sealed.append(
                pb.SealedMessage(sender_site_id=site, sender_public_key=eph, ciphertext=blob)
            )

    def decryptor(self, keys: DecryptorKeys) -> RoundDecryptor:
        work = RoundDecryptor(
            keys, self.signed, site_id="decryptor",
            server_key=signatures.public_key_to_raw(self.server_key), federation_id="fed",
        )  # fmt: skip
        for sealed in self.sealed:
            work.add_tags(sealed)
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
    again, _, _ = work.decrypt(_job("b[A]", data), data)
    assert again == pb.DECRYPTION_STATUS_REFUSED_ALREADY_DECRYPTED


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
        RoundDecryptor(keys, fed.signed, site_id="decryptor", server_key=other, federation_id="fed")
    plaintext = _signed_plan(fed.server_key, mode=cpb.AGGREGATION_MODE_PLAINTEXT)
    with pytest.raises(DaemonError, match="not a CKKS plan"):
        RoundDecryptor(
            keys, plaintext, site_id="decryptor",
            server_key=signatures.public_key_to_raw(fed.server_key), federation_id="fed",
        )  # fmt: skip


def test_keys_are_created_once_and_kept_private(tmp_path: Any) -> None:
    first = load_or_create_keys(tmp_path)
    second = load_or_create_keys(tmp_path)
    assert first.public_context == second.public_context
    assert first.cipher_public_key == second.cipher_public_key
    for path in (tmp_path / "ckks").iterdir():
        assert path.stat().st_mode & 0o777 == 0o600
    assert not ckks.load_public_context(first.public_context).is_private()
