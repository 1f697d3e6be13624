"""A site's `opening` statement: its signed word, in the federation log, that it helps unmask a
masked round's sums over the survivors it signed, or that its ciphertexts enter a CKKS round's
sums over every participant (docs/protocol.md §11a, M-232).

A coordinator that unmasks a round and then leaves its `release` statement out of the log (or
aborts the round and says nothing) would hide that release from every site that did not help
unmask it, and a later pair of plans over those sites could difference to one of them. So before
a site sends its unmask shares it logs an `opening` statement (:func:`opening_of`): the SHA-256
of the round's release as the site knows it (round, run, the survivors it signed, every planned
release, in the `release` statement's form), the round and the plan's SHA-256, signed with its
identity key, which its consistency signature carries (the coordinator logs it before it keeps
the signature). The release itself is an `opened-release`
statement the coordinator logs once per round before the first opening (every party builds the
same bytes from the same release), so a round's openings cost the log O(K) bytes, not O(K²),
and every site that reads the log reads each release once. At the unmask stage the site waits,
as for a plan (M-193), until the opening is in a checkpoint cosigned by a quorum of the roster,
and then verifies that the same checkpoint holds the release (:class:`OpeningPublication`). No
share leaves before; a coordinator that drops the statement unmasks nothing, and hiding it from
the quorum's view needs a colluding quorum. A CKKS site logs the same statement over every
participant as its upload stage begins and sends its first ciphertext only once the statement
and the release are in such a checkpoint: the coordinator that has the round decrypted cannot
hide it either.

Every site's whole-history audit counts the releases of the openings in the log whose signature
verifies under the roster key of the site they name (:func:`opened_releases`), whatever the
coordinator states of the round. A statement that does not verify is not counted (only the
coordinator could have appended it, and an honest survivor's statement is there as well).

What was known before a plan (the exposures the audit does not blame on it) must not rest on any
one party's word (M-233): neither on one site's opening nor on the coordinator's `release`
statements, which the members of a made-up round are not there to contradict. Only a release
that every one of its survivors signed, the same release in an opening each
(:func:`witnessed_releases`), and the rounds this site helped unmask itself count as known
before (``known`` in :func:`afl.client.policy.loghistory.whole_history_problem`); every other
release counts as released only, which can make the audit stricter and never more lenient.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from afl.client.daemon.transparency import Call, LogWitness
from afl.client.daemon.transport import DaemonError
from afl.client.policy.loghistory import LogHistoryError, logged_rounds, release_fields
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import sign_fields, verify_fields
from afl.crypto.transparency.statements import (
    DECRYPTING_CONTEXT,
    OPENING_CONTEXT,
    OPENING_MODES,
    decrypting_signed_fields,
    opened_release_statement,
    opening_signed_fields,
    opening_statement,
    release_sha256,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "Opened",
    "OpeningPublication",
    "OpeningStatements",
    "counted_releases",
    "never_decrypted",
    "opened_releases",
    "opening_of",
    "signed_opening",
    "undecrypted_aborts",
    "witnessed_releases",
]


class Opened(NamedTuple):
    """An opening of the log that verified (:func:`opened_releases`): its signer, the plan's
    SHA-256 (hex), the round's aggregation mode ("mask" or "ckks") and the release it
    states."""

    site: str
    plan_sha256: str
    mode: str
    release: Mapping[str, Any]


class OpeningStatements(NamedTuple):
    """A site's opening of a round (:func:`opening_of`): its signed `opening` statement, and
    the round's `opened-release` statement (the release whose digest it signs)."""

    opening: bytes
    release: bytes


def opening_of(
    key: Ed25519PrivateKey,
    *,
    federation: str,
    site: str,
    plan: cpb.ReleasePlan,
    plan_sha256: bytes,
    survivors: Collection[str],
) -> OpeningStatements:
    """The `opening` statement of ``plan``'s round (a masked or CKKS round) over
    ``survivors``, signed by the site's identity ``key``, and the round's `opened-release`
    statement (:class:`afl.proto.wire.WireError` for another mode)."""
    release = release_fields(plan, survivors=survivors)
    opening = signed_opening(
        key,
        federation=federation,
        site=site,
        round_id=plan.round_id,
        plan_sha256=plan_sha256,
        mode=wire.opening_mode(plan),
        release_sha256=release_sha256(release),
    )
    return OpeningStatements(
        opening, opened_release_statement(federation=federation, release=release)
    )


def signed_opening(
    key: Ed25519PrivateKey,
    *,
    federation: str,
    site: str,
    round_id: str,
    plan_sha256: bytes,
    mode: str,
    release_sha256: bytes,
) -> bytes:
    """The `opening` statement of these fields, signed by ``key`` (context
    :data:`OPENING_CONTEXT`)."""
    fields = opening_signed_fields(
        federation=federation,
        site=site,
        round_id=round_id,
        plan_sha256=plan_sha256,
        mode=mode,
        release_sha256=release_sha256,
    )
    return opening_statement(
        federation=federation,
        site=site,
        round_id=round_id,
        plan_sha256=plan_sha256,
        mode=mode,
        release_sha256=release_sha256,
        signature=sign_fields(key, context=OPENING_CONTEXT, fields=fields),
    )


def opened_releases(
    statements: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    federation: str,
    keys: Mapping[str, Ed25519PublicKey],
    verified: set[str] | None = None,
) -> list[Opened]:
    """Every `opening` statement of the log that verifies under the key in ``keys`` (the
    roster) of the site it names, names a plan the log holds (its round id and SHA-256), and
    signs the digest of an `opened-release` statement of the log that is well formed (as
    :func:`afl.client.policy.loghistory.logged_rounds` reads one), of that round, and lists
    the site among its survivors: its signer, plan digest, mode and that release. An opening
    whose release is not in the log counts nothing (an honest site sends nothing before both
    are in a quorum-cosigned checkpoint). ``verified``: the openings (their fields as
    canonical JSON, signature included) already verified, skipped and extended (a daemon
    keeps one set, so each statement is verified once)."""
    plans = {(f.get("round_id"), f.get("plan_sha256")) for kind, f in statements if kind == "plan"}
    bodies = {  # plain dicts: a witness's statements are read-only views
        release_sha256(f).hex(): dict(f)
        for kind, f in statements
        if kind == "opened-release" and _well_formed(f)
    }
    out: list[Opened] = []
    for kind, fields in statements:
        if kind != "opening":
            continue
        site, round_id, opened = (
            fields.get("site"),
            fields.get("round_id"),
            fields.get("release_sha256"),
        )
        signature, digest = fields.get("signature"), fields.get("plan_sha256")
        mode = fields.get("mode")
        key = keys.get(site) if isinstance(site, str) else None
        release = bodies.get(opened) if isinstance(opened, str) else None
        if (
            key is None
            or mode not in OPENING_MODES
            or release is None
            or not isinstance(signature, str)
            or not isinstance(digest, str)
            or not isinstance(round_id, str)
            or release.get("round_id") != round_id
            or (round_id, digest) not in plans
            or site not in release["survivors"]
        ):
            continue
        seen = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
        if verified is None or seen not in verified:
            try:
                verify_fields(
                    key,
                    bytes.fromhex(signature),
                    context=OPENING_CONTEXT,
                    fields=opening_signed_fields(
                        federation=federation,
                        site=str(site),
                        round_id=round_id,
                        plan_sha256=bytes.fromhex(digest),
                        mode=str(mode),
                        release_sha256=bytes.fromhex(str(opened)),
                    ),
                )
            except (CryptoError, ValueError):
                continue
            if verified is not None:
                verified.add(seen)
        out.append(Opened(str(site), digest, str(mode), release))
    return out


def _by_release(opened: Sequence[Opened]) -> list[tuple[Opened, set[str]]]:
    """Each distinct (plan, mode, release) of ``opened``, once, with the sites that signed it."""
    groups: dict[str, tuple[Opened, set[str]]] = {}
    for o in opened:
        key = json.dumps([o.plan_sha256, o.mode, o.release], sort_keys=True, separators=(",", ":"))
        groups.setdefault(key, (o, set()))[1].add(o.site)
    return list(groups.values())


def counted_releases(opened: Sequence[Opened]) -> list[Mapping[str, Any]]:
    """What the openings of ``opened`` say was released, for the whole-history audit (M-232):
    each distinct release once, over the survivors it states, whoever signed it. A masked
    round's sums hold every survivor's masked input whether or not each survivor lived to log
    its opening; a CKKS round's hold every participant's ciphertext, and a participant that
    colludes with the coordinator may upload without an opening, so counting a CKKS round only
    over the participants that opened it would hide the colluder's part from the audit and let
    a later plan difference an honest site out. (The price: a CKKS round aborted during its
    uploads counts over every participant, so a re-plan without a site it lost is refused;
    docs/protocol.md §11a.)"""
    return [first.release for first, _ in _by_release(opened)]


def witnessed_releases(opened: Sequence[Opened]) -> list[Mapping[str, Any]]:
    """The releases of ``opened`` (:func:`opened_releases`) that every survivor they name
    signed: the same release fields of the same plan in an opening of each. No party's word
    alone makes one: a coordinator cannot sign for a site, and a site that states survivors
    other than the round's real ones would need each of them to sign the same false list."""
    return [
        first.release
        for first, signers in _by_release(opened)
        if set(first.release["survivors"]) <= signers
    ]


def undecrypted_aborts(
    statements: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    federation: str,
    decryptor: str | None,
    keys: Mapping[str, Ed25519PublicKey],
) -> dict[str, int]:
    """The rounds the log records as aborted (`round-aborted`) with no `decrypting` statement
    that verifies under the key of ``decryptor`` (the federation's decryptor, pinned in the
    site's policy) in ``keys`` (the roster), each with the index of its first abort statement
    (docs/protocol.md M-235). Such a CKKS round was never decrypted and never will be, once the
    decryptor has cosigned a checkpoint that holds the abort (:func:`never_decrypted`): it logs
    that statement, in a quorum-cosigned checkpoint, before it decrypts any of a round's sums,
    and refuses a round the log records as aborted before it. Without a pinned decryptor (or its
    key) there are none: every opening counts."""
    key = keys.get(decryptor) if decryptor else None
    if key is None or decryptor is None:
        return {}
    aborted: dict[str, int] = {}
    decrypted: set[str] = set()
    for index, (kind, fields) in enumerate(statements):
        round_id = fields.get("round_id")
        if not isinstance(round_id, str):
            continue
        if kind == "round-aborted":
            aborted.setdefault(round_id, index)
        elif kind == "decrypting" and fields.get("site") == decryptor:
            signature, digest = fields.get("signature"), fields.get("plan_sha256")
            try:
                verify_fields(
                    key,
                    bytes.fromhex(str(signature)),
                    context=DECRYPTING_CONTEXT,
                    fields=decrypting_signed_fields(
                        federation=federation,
                        decryptor=decryptor,
                        round_id=round_id,
                        plan_sha256=bytes.fromhex(str(digest)),
                    ),
                )
            except (CryptoError, ValueError):
                continue
            decrypted.add(round_id)
    return {r: i for r, i in aborted.items() if r not in decrypted}


def never_decrypted(aborts: Mapping[str, int], *, seen_by_decryptor: int) -> set[str]:
    """The rounds of ``aborts`` (:func:`undecrypted_aborts`) whose abort is among the first
    ``seen_by_decryptor`` statements: the size of a checkpoint of this site's log that the
    decryptor cosigned. Its openings release nothing (M-235): the decryptor keeps the last
    checkpoint it cosigned and never cosigns one that does not extend it, so every statement it
    logs later comes after the abort, and it refuses the round; a log shown to the decryptor
    without the abort (a fork, or a restore that drops it) is a split view to it. A round whose
    abort the decryptor has not cosigned still counts as released, decrypted or pending."""
    return {r for r, index in aborts.items() if index < seen_by_decryptor}


def _well_formed(release: Mapping[str, Any]) -> bool:
    try:
        logged_rounds([("release", release)])
    except LogHistoryError:
        return False
    return True


class OpeningPublication:
    """One round's opening (module docstring). In ``mask``, the site's consistency signature
    carries it (:meth:`carried`, once the site has checked the survivors), and the coordinator
    logs it before it keeps the signature, so every survivor's opening is in the log once the
    coordinator has their signatures and opens the unmask stage;
    :meth:`wait`, at that stage and before any unmask share is computed, returns once the
    statement is in a quorum-cosigned checkpoint and the round's `opened-release` statement is
    in that checkpoint too (:class:`DaemonError` naming the cause when either is not). Waiting
    there, every survivor cosigns the same checkpoint, the one holding all their openings: a
    quorum gathers on it at once, where survivors waiting from the moment each logged its own
    would cosign a checkpoint per opening, and those that found their quorum early would stop
    cosigning before the last openings were in. In ``ckks`` the site starts it over every
    participant as its upload stage begins (while it encrypts) and waits for it before its
    first statistic leaves (``withheld``: what is not sent until then)."""

    def __init__(
        self,
        witness: LogWitness,
        call: Call,
        *,
        key: Ed25519PrivateKey,
        plan: cpb.ReleasePlan,
        plan_sha256: bytes,
        quorum_wait: Callable[..., tuple[str, pb.CosignedLogCheckpoint | None]],
        withheld: str = "no unmask share is sent",
    ) -> None:
        self.witness, self.call, self.key = witness, call, key
        self.plan, self.plan_sha256 = plan, plan_sha256
        self.quorum_wait, self.withheld = quorum_wait, withheld
        self.what = f"this site's opening of round {plan.round_id}"
        self.statements: OpeningStatements | None = None
        #: Set: the round ended meanwhile; a wait in progress returns at its next poll.
        self.stopped = threading.Event()

    def carried(self, survivors: Collection[str]) -> bytes:
        """``mask``: the signed opening over ``survivors``, for the consistency signature to
        carry (the coordinator logs it before it keeps the signature; :meth:`wait` then finds it
        in the log, or names its absence)."""
        self.statements = self._statements(survivors)
        return self.statements.opening

    def _statements(self, survivors: Collection[str]) -> OpeningStatements:
        return opening_of(
            self.key,
            federation=self.witness.federation_id,
            site=self.witness.site_id,
            plan=self.plan,
            plan_sha256=self.plan_sha256,
            survivors=survivors,
        )

    def start(self, survivors: Collection[str]) -> None:
        """Log the opening over ``survivors`` (RecordOpening): ``ckks``, as the upload stage
        begins."""
        statements = self._statements(survivors)
        try:
            self.call("RecordOpening", pb.Opening(statement=statements.opening))
        except DaemonError as exc:
            raise DaemonError(
                f"the coordinator did not log {self.what} ({exc}): {self.withheld}"
            ) from exc
        self.statements = statements

    def wait(self) -> None:
        if self.statements is None:
            raise DaemonError(f"no opening was logged for the survivors: {self.withheld}")
        problem, found = self.quorum_wait(
            statement=self.statements.opening,
            what=self.what,
            stop=self.stopped,
            also=self.statements.release,  # its inclusion proof comes with the answers
        )
        if problem or found is None:
            raise DaemonError(f"{problem or 'no checkpoint was answered'}: {self.withheld}")
        try:  # the release it signs the digest of, in the same quorum-cosigned checkpoint
            self.witness.prove_included(self.call, self.statements.release, found, also=True)
        except DaemonError as exc:
            raise DaemonError(
                f"the release {self.what} signs is not in the log checkpoint of size "
                f"{found.checkpoint.size} ({exc}): {self.withheld}"
            ) from exc
