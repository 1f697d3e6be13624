"""Tests of afl.crypto.ckks.decrypt.Decryptor: plan membership, tags, decrypt-once (docs/protocol.md
§4.3).

Tolerance: ``ckks_params.error_bound`` (derived from Δ, K, the pre-scale and the grid; see the
ckks_params docstring), against the float64 sum of the members' vectors.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import tenseal as ts

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import CkksRelease, Decryptor
from afl.crypto.errors import (
    CkksAlreadyDecryptedError,
    CkksConfigError,
    CkksContextError,
    CkksMalformedError,
    CkksNotInPlanError,
    CkksTagMismatchError,
)

SITES = ("site-a", "site-b", "site-c", "site-d")
N = 600
BOUND = 50.0
K_UPLOAD = 3  # largest member count among the releases sharing upload "gram"


def _release(name: str, members: tuple[str, ...]) -> CkksRelease:
    s = cp.choose_prescale(bound=BOUND, num_summands=K_UPLOAD)
    return CkksRelease(
        name=name,
        members=members,
        upload_name="gram",
        length=N,
        prescale=s,
        grid=cp.default_grid(prescale=s, num_summands=len(members)),
    )


PLAN = (_release("gram/abc", SITES[:3]), _release("gram/ab", SITES[:2]))


class Federation:
    """Three sites upload one 'gram' block each; the test plays the server."""

    def __init__(self, private_ctx: ts.Context, public_ctx: ts.Context) -> None:
        rng = np.random.default_rng(7)  # test data, not secrets
        self.public_ctx = public_ctx
        self.values = {site: rng.uniform(-BOUND, BOUND, N) for site in SITES[:3]}
        self.tags = {site: ckks.new_tag(num_summands=K_UPLOAD) for site in SITES[:3]}
        s = PLAN[0].prescale
        self.uploads = {
            site: ckks.serialize_ciphertexts(
                ckks.encrypt_block(
                    public_ctx, x, prescale=s, num_summands=K_UPLOAD, tag=self.tags[site]
                )
            )
            for site, x in self.values.items()
        }
        self.decryptor = Decryptor(private_ctx, PLAN)
        for site, tag in self.tags.items():
            self.decryptor.register_tags(site=site, tags={"gram": tag})

    def server_sum(self, sites: tuple[str, ...]) -> list[bytes]:
        on_server = [
            ckks.deserialize_ciphertexts(self.public_ctx, self.uploads[s], length=N) for s in sites
        ]
        return ckks.serialize_ciphertexts(
            ckks.sum_ciphertexts(self.public_ctx, on_server, length=N)
        )

    def exact(self, sites: tuple[str, ...]) -> np.ndarray:
        return np.array(
            [math.fsum(col) for col in zip(*(self.values[s] for s in sites), strict=True)]
        )


@pytest.fixture
def fed(private_ctx: ts.Context, public_ctx: ts.Context) -> Federation:
    return Federation(private_ctx, public_ctx)


def test_planned_releases_decrypt_to_the_plaintext_sums(fed: Federation) -> None:
    for release in PLAN:
        out = fed.decryptor.decrypt(
            release.name, fed.server_sum(release.members), members=release.members
        )
        tol = cp.error_bound(
            prescale=release.prescale, num_summands=release.num_summands, grid=release.grid
        )
        assert np.max(np.abs(out - fed.exact(release.members))) <= tol
    assert fed.decryptor.decrypted == {"gram/abc", "gram/ab"}


def test_each_release_is_decrypted_for_one_aggregate_only(fed: Federation) -> None:
    summed = fed.server_sum(SITES[:3])
    first = fed.decryptor.decrypt("gram/abc", summed, members=SITES[:3])
    # The same aggregate again (a lost reply, a restarted coordinator): the same values.
    again = fed.decryptor.decrypt("gram/abc", summed, members=SITES[:3])
    assert np.array_equal(first, again)
    # Another aggregate under that name (a second combination to difference against the first):
    # refused before the key is applied.
    other = fed.server_sum(SITES[:2])
    with pytest.raises(CkksAlreadyDecryptedError, match="another aggregate"):
        fed.decryptor.decrypt("gram/abc", other, members=SITES[:3])


def test_bindings_are_restored_and_recorded_before_the_key_is_applied(
    private_ctx: ts.Context, fed: Federation
) -> None:
    summed = fed.server_sum(SITES[:3])
    digest = hashlib.sha256(ckks.pack_ciphertexts(summed)).digest()
    # A restarted decryptor is given the bindings an earlier process made: another aggregate is
    # refused, the bound one decrypts again.
    restarted = Decryptor(private_ctx, PLAN, decrypted={"gram/abc": hashlib.sha256(b"x").digest()})
    for site, tag in fed.tags.items():
        restarted.register_tags(site=site, tags={"gram": tag})
    with pytest.raises(CkksAlreadyDecryptedError):
        restarted.decrypt("gram/abc", summed, members=SITES[:3])
    recorded: list[tuple[str, bytes]] = []
    resumed = Decryptor(
        private_ctx,
        PLAN,
        decrypted={"gram/abc": digest},
        on_decrypt=lambda name, d: recorded.append((name, d)),
    )
    for site, tag in fed.tags.items():
        resumed.register_tags(site=site, tags={"gram": tag})
    out = resumed.decrypt("gram/abc", summed, members=SITES[:3])
    assert np.max(np.abs(out - fed.exact(SITES[:3]))) < 1e-3
    assert recorded == []  # already durable
    # on_decrypt runs once the release is bound, before decryption; if it fails, nothing is
    # decrypted, a retry of the same aggregate tries to record again, and another aggregate is
    # refused.
    attempts: list[str] = []

    def refuse(name: str, bound: bytes) -> None:
        attempts.append(name)
        raise OSError("disk full")

    failing = Decryptor(private_ctx, PLAN, on_decrypt=refuse)
    for site, tag in fed.tags.items():
        failing.register_tags(site=site, tags={"gram": tag})
    pair = fed.server_sum(SITES[:2])
    for _ in range(2):
        with pytest.raises(OSError):
            failing.decrypt("gram/ab", pair, members=SITES[:2])
    assert attempts == ["gram/ab", "gram/ab"] and failing.decrypted == {"gram/ab"}
    with pytest.raises(CkksAlreadyDecryptedError):
        failing.decrypt("gram/ab", summed, members=SITES[:2])


def test_release_not_in_plan_is_refused(fed: Federation) -> None:
    with pytest.raises(CkksNotInPlanError, match="not in the signed plan"):
        fed.decryptor.decrypt("gram/a", fed.uploads["site-a"], members=("site-a",))
    assert fed.decryptor.decrypted == frozenset()


def test_member_list_other_than_the_plan_is_refused(fed: Federation) -> None:
    with pytest.raises(CkksNotInPlanError, match="members differ"):
        fed.decryptor.decrypt("gram/abc", fed.server_sum(SITES[:2]), members=SITES[:2])
    with pytest.raises(CkksNotInPlanError, match="members differ"):
        fed.decryptor.decrypt("gram/abc", fed.server_sum(SITES[:3]), members=(*SITES[:2], "site-a"))
    assert fed.decryptor.decrypted == frozenset()


def test_single_site_forwarded_as_three_site_sum_is_refused(fed: Federation) -> None:
    # The server claims the plan's members but forwards site-a's ciphertext alone.
    with pytest.raises(CkksTagMismatchError):
        fed.decryptor.decrypt("gram/abc", fed.uploads["site-a"], members=SITES[:3])
    # The attempt consumed the release: no second try with another forgery.
    with pytest.raises(CkksAlreadyDecryptedError):
        fed.decryptor.decrypt("gram/abc", fed.server_sum(SITES[:3]), members=SITES[:3])


def test_sum_over_the_wrong_member_set_is_refused(fed: Federation) -> None:
    # Sum of a and b presented as the 3-site release (claiming the right members).
    with pytest.raises(CkksTagMismatchError):
        fed.decryptor.decrypt("gram/abc", fed.server_sum(SITES[:2]), members=SITES[:3])
    # Sum of a, b, c presented as release {a, b}.
    with pytest.raises(CkksTagMismatchError):
        fed.decryptor.decrypt("gram/ab", fed.server_sum(SITES[:3]), members=SITES[:2])


def test_malformed_ciphertexts_do_not_consume_the_release(fed: Federation) -> None:
    summed = fed.server_sum(SITES[:3])
    with pytest.raises(CkksMalformedError):
        fed.decryptor.decrypt("gram/abc", [*summed[:-1], b"junk"], members=SITES[:3])
    with pytest.raises(CkksMalformedError):
        fed.decryptor.decrypt("gram/abc", summed + summed, members=SITES[:3])
    assert fed.decryptor.decrypted == frozenset()
    out = fed.decryptor.decrypt("gram/abc", summed, members=SITES[:3])
    assert out.shape == (N,)


def test_missing_tag_is_refused(private_ctx: ts.Context, fed: Federation) -> None:
    decryptor = Decryptor(private_ctx, PLAN)
    decryptor.register_tags(site="site-a", tags={"gram": fed.tags["site-a"]})
    with pytest.raises(CkksTagMismatchError, match="no valid tag"):
        decryptor.decrypt("gram/ab", fed.server_sum(SITES[:2]), members=SITES[:2])
    assert decryptor.decrypted == frozenset()


def test_tag_registration_rules(fed: Federation) -> None:
    fed.decryptor.register_tags(site="site-a", tags={"gram": fed.tags["site-a"]})  # idempotent
    with pytest.raises(CkksConfigError, match="another tag"):
        fed.decryptor.register_tags(site="site-a", tags={"gram": fed.tags["site-a"] + 1.0})
    with pytest.raises(CkksNotInPlanError):
        fed.decryptor.register_tags(site="site-d", tags={"gram": 1.0})
    with pytest.raises(CkksNotInPlanError):
        fed.decryptor.register_tags(site="site-a", tags={"b": 1.0})


def test_plan_validation(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    with pytest.raises(CkksConfigError, match="twice"):
        Decryptor(private_ctx, [PLAN[0], PLAN[0]])
    with pytest.raises(CkksContextError):
        Decryptor(public_ctx, PLAN)
    with pytest.raises(CkksConfigError, match="sorted"):
        CkksRelease("r", ("b", "a"), "u", N, 1.0, 1.0)
    with pytest.raises(CkksConfigError, match="finer"):
        CkksRelease("r", ("a",), "u", N, 1.0, cp.min_grid(prescale=1.0, num_summands=1) / 2)


def test_blocks_mixed_across_positions_are_refused(
    private_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    """An upload of more than one ciphertext carries its tag in every block: a server that adds
    site-c's block 1 where its block 0 belongs keeps every tag slot at Σ r_k, and the difference
    of the two decrypted blocks would then be x_c[block 0] − x_c[block 1], a statistic of ONE
    site. Each block's tag must be bound to its position."""
    n = 2 * cp.DATA_SLOTS_PER_CIPHERTEXT
    s = cp.choose_prescale(bound=BOUND, num_summands=3)
    release = CkksRelease(
        name="gram/abc",
        members=SITES[:3],
        upload_name="gram",
        length=n,
        prescale=s,
        grid=cp.default_grid(prescale=s, num_summands=3),
    )
    rng = np.random.default_rng(11)  # test data, not secrets
    tags = {site: ckks.new_tag(num_summands=3) for site in SITES[:3]}
    uploads = {
        site: ckks.encrypt_block(
            public_ctx, rng.uniform(-BOUND, BOUND, n), prescale=s, num_summands=3, tag=tags[site]
        )
        for site in SITES[:3]
    }
    decryptor = Decryptor(private_ctx, [release])
    for site, tag in tags.items():
        decryptor.register_tags(site=site, tags={"gram": tag})
    a, b, c = (uploads[site] for site in SITES[:3])
    mixed = [a[0] + b[0] + c[0], a[0] + b[0] + c[1]]  # block 1 of the "sum" reuses block 0
    with pytest.raises(CkksTagMismatchError):
        decryptor.decrypt("gram/abc", ckks.serialize_ciphertexts(mixed), members=SITES[:3])
