"""The CKKS decryptor site: an ``afl-client run`` whose client.toml says ``role = "decryptor"``
(docs/protocol.md §4.3).

Choice: the decryptor is a DEDICATED site that holds no data (it is never a round participant;
[data] is optional in its client.toml). It sees every released sum, which the server learns
anyway, and nothing else; keeping it out of the data sites means a hospital's statistics are
never decrypted by another hospital's process. Trust assumption: the decryptor and the server do
not collude (TenSEAL has no threshold decryption).

Startup: load (or create once, then keep under ``state_dir/ckks/``, mode 0600) the asymmetric
CKKS context with its secret key and an X25519 key for receiving aggregate tags; enrol; upload
the PUBLIC context (no secret, Galois or relinearization keys) and publish a signed announcement.

Loop: ``GetDecryptionJobs`` for the current round; its jobs run on :data:`JOB_WORKERS` threads
(one job's transfers and report overlap another's decryption; the decryptions take turns). For
each round, :class:`RoundDecryptor`
verifies the server's signature on the release plan (key from the kit), refuses plans not in CKKS
mode, plans whose roster digest is not the one of its kit's roster (``[peers]`` and itself) and
plans naming a participant the federation CA revoked (``[tls] crl``; both checks are the sites'
own, :mod:`afl.client.policy.roster`, M-224), opens the sealed tags and builds an
:class:`afl.crypto.ckks.decrypt.Decryptor`. A site's
tags count only if that site signed them with its identity key from this decryptor's kit
([peers]) for this federation, round, plan digest and this decryptor's tag key
(:func:`afl.crypto.ckks.wire.open_tags`): tags the server sealed itself "from" a site are
ignored. A release is decrypted only if it is in the signed plan with exactly the plan's
members, each of which sent valid tags, at most once, and only if every tag slot equals the sum
of the members' secret tags (a single site's ciphertext forwarded as a "sum" is refused).
Decoded values are divided by the pre-scale and rounded to the plan's grid (Li–Micciancio). The
result (float64, packed like the upload) goes back through ``Upload`` (DECRYPTED_AGGREGATE) and
the signed outcome through ``ReportDecryption``; refusals are reported too.

Decrypt-once survives a restart: before the secret key touches a release, (round, release, SHA-256
of the aggregate) is recorded in ``state_dir/ckks/decrypted.json`` (written atomically, mode
0600; :class:`DecryptionLedger`). A restarted decryptor decrypts a listed release again only for
the same aggregate bytes (a retry after a lost reply or a coordinator restart: deterministic, so
nothing new is revealed) and refuses any other aggregate under that name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from google.protobuf.message import DecodeError
from numpy.typing import NDArray

from afl.client.config import ClientConfig
from afl.client.connectivity import connect
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transparency import (
    QUORUM_POLL_S,
    LogWitness,
    SplitViewDetected,
)
from afl.client.daemon.transport import (
    INSECURE_SITE_HEADER,
    CoordinatorRefused,
    DaemonError,
    RemoteCallError,
    retry_policy,
)
from afl.client.daemon.verify import VerificationError, verify_signed_plan
from afl.client.policy.roster import (
    kit_revocations,
    kit_roster,
    revoked_participant,
    roster_mismatch,
)
from afl.core.influence import InfluenceBound, class_vector_problem, gram_problem
from afl.core.packing import unpack_upper
from afl.crypto import kdf
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import CkksRelease, Decryptor
from afl.crypto.ckks.wire import (
    CKKS_CONTEXT_CONTEXT,
    DECRYPTION_CONTEXT,
    context_fields,
    decryption_fields,
    open_tags,
)
from afl.crypto.errors import (
    CkksAlreadyDecryptedError,
    CkksMalformedError,
    CkksNotInPlanError,
    CkksTagMismatchError,
    CryptoError,
)
from afl.crypto.identity import pki, signatures
from afl.crypto.identity.revocation import PeerRevocations
from afl.crypto.identity.signed_blobs import blob_sha256
from afl.crypto.transparency.statements import (
    DECRYPTING_CONTEXT,
    decode_statement,
    decrypting_signed_fields,
    decrypting_statement,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "DecryptionLedger",
    "DecryptorDaemon",
    "DecryptorKeys",
    "PlanRefused",
    "RoundDecryptor",
    "load_or_create_keys",
]

log = logging.getLogger("afl.client.daemon.decryptor")

#: Jobs of a round served at once: one job's download, result upload and report overlap another
#: job's decryption (the decryptions take turns: :attr:`RoundDecryptor.turn`).
JOB_WORKERS = 2
#: How often the idle decryptor witnesses the log's newest checkpoint (seconds). One process per
#: federation: more often than the sites (afl.client.daemon.transparency.IDLE_WITNESS_S), since a
#: site's audit waits for its cosignature on a checkpoint that holds a CKKS round's abort (M-235).
WITNESS_S = 1.0


class PlanRefused(DaemonError):
    """The decryptor refuses a job's release plan, before any key is used (its reason names
    why); the daemon reports it to the coordinator as a signed ``REFUSED_PLAN`` outcome."""


_STATUS = {
    CkksNotInPlanError: pb.DECRYPTION_STATUS_REFUSED_NOT_IN_PLAN,
    CkksAlreadyDecryptedError: pb.DECRYPTION_STATUS_REFUSED_ALREADY_DECRYPTED,
    CkksTagMismatchError: pb.DECRYPTION_STATUS_REFUSED_TAG_MISMATCH,
}


class DecryptorKeys:
    """The decryptor's CKKS context (with secret key) and its X25519 tag-receiving key."""

    def __init__(self, ctx: Any, agreement: X25519PrivateKey) -> None:
        ckks.ensure_private(ctx)
        self.ctx = ctx
        self.agreement = agreement
        self.public_context = ckks.public_context_bytes(ctx)
        self.cipher_public_key = kdf.public_key_bytes(agreement)


def load_or_create_keys(state_dir: Path) -> DecryptorKeys:
    """Keys from ``state_dir/ckks`` (created once with a CSPRNG, files mode 0600)."""
    folder = pki.make_private_dir(state_dir / "ckks")
    ctx_path, x_path = folder / "private_context.bin", folder / "tags_x25519.key"
    if ctx_path.is_file() and x_path.is_file():
        ctx = ckks.load_private_context(ctx_path.read_bytes())
        agreement = kdf.load_agreement_private_key(x_path.read_bytes())
        return DecryptorKeys(ctx, agreement)
    ctx = ckks.create_private_context()
    agreement = kdf.generate_agreement_key()
    pki.write_private_file(ctx_path, ckks.private_context_bytes(ctx))
    pki.write_private_file(x_path, kdf.private_key_bytes(agreement))
    return DecryptorKeys(ctx, agreement)


class DecryptionLedger:
    """The aggregate each release was bound to before this decryptor applied its secret key,
    per round, on disk (``<folder>/decrypted.json``: round → release → SHA-256 hex, rewritten
    atomically with mode 0600 at every record)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "decrypted.json"
        self._rounds: dict[str, dict[str, str]] = {}
        if self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text(encoding="utf-8"))
                self._rounds = {
                    str(r): {str(n): str(d) for n, d in bound.items()}
                    for r, bound in loaded.items()
                }
            except (OSError, ValueError, AttributeError) as exc:
                raise DaemonError(
                    f"{self.path}: unreadable decrypt-once record ({exc}); refusing to start "
                    "(it must never be lost: restore it from backup)"
                ) from exc

    def used(self, round_id: str) -> dict[str, bytes]:
        """Release → aggregate digest of ``round_id``'s releases already decrypted (or
        attempted)."""
        return {n: bytes.fromhex(d) for n, d in self._rounds.get(round_id, {}).items()}

    def record(self, round_id: str, release: str, digest: bytes) -> None:
        """Bind (round, release) to ``digest``, durably, before the secret key is applied; a
        release bound to another aggregate (by any round state of this process or an earlier
        one) stays bound: :class:`CkksAlreadyDecryptedError`."""
        bound = self._rounds.get(round_id, {}).get(release)
        if bound is not None and bound != digest.hex():
            raise CkksAlreadyDecryptedError(
                f"release {release!r} of round {round_id} was already decrypted for another "
                "aggregate"
            )
        self._rounds.setdefault(round_id, {})[release] = digest.hex()
        text = json.dumps(self._rounds, indent=1, sort_keys=True)
        try:
            pki.write_private_file(self.path, text.encode("utf-8"))
        except OSError as exc:
            raise DaemonError(
                f"{self.path}: cannot record the decryption of {release!r} ({exc}); refusing "
                "to decrypt it"
            ) from exc


class RoundDecryptor:
    """One round's decryption state (module docstring); transport-free, so it is unit-tested."""

    def __init__(
        self,
        keys: DecryptorKeys,
        signed_plan: cpb.SignedReleasePlan,
        *,
        site_id: str,
        server_key: bytes,
        federation_id: str,
        peers: Mapping[str, bytes],
        roster: Mapping[str, bytes],
        revocations: PeerRevocations | None = None,
        ledger: DecryptionLedger | None = None,
        site_bound: InfluenceBound | None = None,
    ) -> None:
        """``roster``: every site's identity key in this decryptor's kit (:func:`kit_roster`),
        whose digest the plan must bind; ``revocations``: the kit's CRL (None without
        ``[tls] crl``). A refused plan is a :class:`DaemonError` naming why, before any key is
        used."""
        try:
            plan, plan_sha = verify_signed_plan(
                signed_plan,
                server_key=signatures.load_public_key_raw(server_key),
                federation_id=federation_id,
                what="decryption job",
            )
        except (VerificationError, CryptoError) as exc:
            raise PlanRefused(str(exc)) from exc
        if plan.aggregation != cpb.AGGREGATION_MODE_CKKS:
            raise PlanRefused("the release plan is not a CKKS plan of this federation")
        problem = roster_mismatch(plan, federation_id=federation_id, roster=roster)
        problem = problem or revoked_participant(
            plan, revocations=revocations, peers=peers, site_id=site_id
        )
        if problem:
            raise PlanRefused(f"the decryptor refuses round {plan.round_id}: {problem}")
        self.plan, self.keys, self.site_id = plan, keys, site_id
        self.plan_sha256, self.peers = plan_sha, dict(peers)
        self.releases = {r.name: r for r in plan.releases}
        round_id = plan.round_id
        self.decryptor = Decryptor(
            keys.ctx,
            [
                CkksRelease(
                    name=r.name,
                    members=tuple(r.member_site_ids),
                    upload_name=r.upload_name or r.name,
                    length=wire.release_length(r),
                    prescale=r.encoding.ckks.prescale,
                    grid=r.encoding.ckks.grid_step,
                )
                for r in plan.releases
            ],
            decrypted=None if ledger is None else ledger.used(round_id),
            on_decrypt=None
            if ledger is None
            else lambda name, digest: ledger.record(round_id, name, digest),
        )
        self.senders: set[str] = set()
        self.site_bound = site_bound  # one member's dataset bound (None: not checked)
        #: Held while one job is decrypted: concurrent jobs take turns (the decrypt-once record
        #: is shared); re-entrant, so a caller may hold it around :meth:`decrypt` to time it.
        self.turn = threading.RLock()

    def add_tags(self, sealed: pb.SealedMessage) -> None:
        """Open one site's sealed AggregateTags and register them (each sender once); a
        ``CryptoError`` when the site's signature (key from the kit) or the blob does not check."""
        sender = sealed.sender_site_id
        if sender in self.senders or sender not in self.plan.participants:
            return
        if sender not in self.peers:
            raise CkksMalformedError(f"no identity key for {sender!r} in this decryptor's kit")
        binding = wire.tag_binding(
            self.plan,
            plan_sha256=self.plan_sha256,
            sender=sender,
            decryptor=self.site_id,
            decryptor_key=self.keys.cipher_public_key,
        )
        plaintext = open_tags(
            wire.sealed_tags_from_proto(sealed),
            binding=binding,
            sender_identity=signatures.load_public_key_raw(self.peers[sender]),
            recipient_private_key=self.keys.agreement,
        )
        try:
            message = pb.AggregateTags.FromString(plaintext)
        except DecodeError as exc:
            raise CkksMalformedError(
                f"the tags of {sender!r} are not an AggregateTags message"
            ) from exc
        if message.site_id != sender or message.round_id != self.plan.round_id:
            raise CkksMalformedError("aggregate tags name another sender or round")
        self.decryptor.register_tags(
            site=sender, tags={t.upload_name: t.value for t in message.tags}
        )
        self.senders.add(sender)

    def decrypt(self, job: pb.DecryptionJob, aggregate: bytes) -> tuple[int, str, bytes]:
        """(status, reason, float64 result bytes) for one job; never raises for a refusal.
        Thread-safe: concurrent jobs take turns (the decrypt-once record is shared)."""
        with self.turn:
            return self._decrypt(job, aggregate)

    def _decrypt(self, job: pb.DecryptionJob, aggregate: bytes) -> tuple[int, str, bytes]:
        try:
            if hashlib.sha256(aggregate).digest() != job.ciphertext_sha256:
                raise CkksMalformedError("aggregate bytes differ from the job's digest")
            values = self.decryptor.decrypt(
                job.release_name,
                ckks.unpack_ciphertexts(aggregate),
                members=list(job.member_site_ids),
            )
        except (CkksNotInPlanError, CkksAlreadyDecryptedError, CkksTagMismatchError) as exc:
            return _STATUS[type(exc)], str(exc), b""
        except CryptoError as exc:
            return pb.DECRYPTION_STATUS_REFUSED_MALFORMED, str(exc), b""
        problem = self._bound_problem(job.release_name, values, members=len(job.member_site_ids))
        if problem:
            return pb.DECRYPTION_STATUS_REFUSED_OUT_OF_BOUND, problem, b""
        return pb.DECRYPTION_STATUS_DECRYPTED, "", values.astype("<f8").tobytes()

    def _bound_problem(self, name: str, values: NDArray[np.float64], *, members: int) -> str:
        """Why the decrypted sum of ``name`` over ``members`` sites lies outside what that many
        datasets within :attr:`site_bound` could produce ("" if it does not, or unchecked: no
        bound, DP noise, other statistics; :mod:`afl.core.influence`)."""
        release = self.releases.get(name)
        if self.site_bound is None or release is None or self.plan.dp.enabled:
            return ""
        total = InfluenceBound(0.0, 0.0, 0.0)
        for _ in range(members):
            total = total + self.site_bound
        if release.kind == cpb.STATISTIC_KIND_GRAM:
            gram = values
            if release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE:
                gram = unpack_upper(values)
            problem = gram_problem(gram.reshape(tuple(release.shape)), bound=total)
        elif release.kind == cpb.STATISTIC_KIND_CLASS_VECTOR:
            vectors = values.reshape(tuple(release.shape))
            problem = class_vector_problem(vectors, bound=total, classes=tuple(release.class_names))
        else:
            return ""
        if not problem:
            return ""
        return (
            f"release {name!r}, the sum of {members} member(s): {problem} (per member N <= "
            f"{self.site_bound.count:g}, 2L = {self.site_bound.vector_norm:g}: this decryptor's "
            "[policy] decrypt_max_rows and decrypt_max_row_norm)"
        )


def _site_bound(config: ClientConfig) -> InfluenceBound | None:
    """One member's dataset bound from the decryptor's [policy] (None when not set)."""
    rows, norm = config.policy.decrypt_max_rows, config.policy.decrypt_max_row_norm
    if rows <= 0 or norm <= 0:
        return None
    return InfluenceBound.of_dataset(rows=rows, max_row_norm=norm)


class DecryptorDaemon:
    """The decryptor's process: publish the public context, then serve decryption jobs."""

    #: Whether a round's `decrypting` statement is logged, under a quorum, before its first
    #: decryption (M-235); a relay that carries no federation log (the Flower app) sets False.
    logs_decryption = True

    def __init__(
        self, config: ClientConfig, *, insecure: bool = False, max_idle_s: float | None = None
    ) -> None:
        if config.role != "decryptor":
            raise DaemonError("DecryptorDaemon needs role = 'decryptor' in client.toml")
        self.config = config
        self.insecure = insecure
        self.max_idle_s = max_idle_s
        self.identity = signatures.load_private_key_pem(config.identity_key_path.read_bytes())
        t = config.timing
        self.retry = retry_policy(t)
        self.metadata: tuple[tuple[str, str], ...] = (
            ((INSECURE_SITE_HEADER, config.site_id),) if insecure else ()
        )
        self.keys = load_or_create_keys(config.state_dir)
        self.ledger = DecryptionLedger(config.state_dir / "ckks")
        self.revocations = kit_revocations(config)
        self.rounds: dict[str, RoundDecryptor] = {}
        self.refused: set[tuple[str, bytes]] = set()  # (round, plan digest) reported refused
        #: (round, plan digest) whose `decrypting` statement a quorum checkpoint holds (M-235)
        self.decrypting: set[tuple[str, bytes]] = set()
        self._recording = threading.Lock()  # job timings appended by concurrent jobs
        self.rpc: CoordinatorClient | None = None
        # The decryptor witnesses the federation log too (docs/protocol.md §11a, M-192).
        self.log_witness = LogWitness.for_site(config, self.identity)
        self._witnessed_at = 0.0

    def witness(self) -> None:
        """Cosign the log's newest checkpoint (at most every :data:`WITNESS_S`); a split
        view stops the decryptor (:class:`SplitViewDetected`)."""
        now = time.monotonic()
        if now - self._witnessed_at < WITNESS_S:
            return
        self._witnessed_at = now
        self.log_witness.witness(self._rpc().call)

    def _rpc(self) -> CoordinatorClient:
        if self.rpc is None:
            raise DaemonError("the decryptor is not connected (call run())")
        return self.rpc

    def enroll_and_publish(self) -> None:
        c, rpc = self.config, self._rpc()
        rpc.enroll(
            federation_id=c.federation_id,
            identity=self.identity,
            identity_public_key=c.identity_public_key,
            server_public_key=c.server_public_key,
            role=pb.SITE_ROLE_DECRYPTOR,
        )
        data = self.keys.public_context
        digest = hashlib.sha256(data).digest()
        rpc.upload(
            data,
            round_id="ckks",
            release_name="ckks/context",
            kind=pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT,
        )
        signature = signatures.sign_fields(
            self.identity,
            context=CKKS_CONTEXT_CONTEXT,
            fields=context_fields(
                round_id="", context_sha256=digest, cipher_public_key=self.keys.cipher_public_key
            ),
        )
        rpc.call(
            "PublishCkksContext",
            pb.CkksContextAnnouncement(
                context_sha256=digest,
                size_bytes=len(data),
                cipher_public_key=self.keys.cipher_public_key,
                signature=signature,
            ),
        )
        log.info("decryptor=%s published its public CKKS context (%d bytes)", c.site_id, len(data))

    def _round(self, jobs: pb.DecryptionJobs) -> RoundDecryptor:
        work = self.rounds.get(jobs.round_id)
        if work is None:
            work = RoundDecryptor(
                self.keys,
                jobs.release_plan,
                site_id=self.config.site_id,
                server_key=self.config.server_public_key,
                federation_id=self.config.federation_id,
                peers=self.config.peers,
                roster=kit_roster(self.config),
                revocations=self.revocations,
                ledger=self.ledger,
                site_bound=_site_bound(self.config),
            )
            if work.plan.round_id != jobs.round_id:
                raise DaemonError(
                    f"decryption jobs of round {jobs.round_id[:80]!r} carry the plan of round "
                    f"{work.plan.round_id!r}"
                )
            self.rounds[jobs.round_id] = work
        return work

    def serve_once(self) -> int:
        """Handle the pending jobs of the current round; returns how many were handled."""
        rpc = self._rpc()
        jobs: pb.DecryptionJobs = rpc.call("GetDecryptionJobs", cpb.RoundRef())
        if not jobs.jobs:
            return 0
        refusal = (jobs.round_id, blob_sha256(jobs.release_plan.plan))
        if refusal in self.refused:
            return 0  # reported already; the round is aborting
        try:
            work = self._round(jobs)
        except PlanRefused as exc:  # the coordinator learns why at once (the round aborts)
            self._refuse(jobs, refusal[1], str(exc))
            self.refused.add(refusal)
            return len(jobs.jobs)
        problem = self._decrypting(work)  # in the log first (M-235)
        if problem:
            self._refuse(jobs, refusal[1], problem)
            self.refused.add(refusal)
            return len(jobs.jobs)
        tags: pb.SealedMessages = rpc.call("GetAggregateTags", cpb.RoundRef(round_id=jobs.round_id))
        for sealed in tags.messages:
            try:
                work.add_tags(sealed)
            except CryptoError as exc:
                log.warning("decryptor: tags from %s refused: %s", sealed.sender_site_id, exc)
        with ThreadPoolExecutor(max_workers=JOB_WORKERS, thread_name_prefix="decrypt-job") as pool:
            futures = [pool.submit(self._serve_job, work, jobs.round_id, job) for job in jobs.jobs]
            try:
                for future in futures:
                    future.result()  # the first failure is raised once the running jobs end
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return len(jobs.jobs)

    def _decrypting(self, work: RoundDecryptor) -> str:
        """Log this decryptor's signed `decrypting` statement of the round (docs/protocol.md
        M-235) and wait until a checkpoint cosigned by a quorum of the roster holds it, before
        the secret key touches any of the round's sums; why it must not decrypt ("" when it
        may): the log records the round as aborted before the statement (a coordinator that
        aborted a round, so that every site's audit counts it as never released, does not get
        it decrypted afterwards). :class:`DaemonError` when the statement is not logged under
        a quorum (the next poll tries again; nothing is decrypted meanwhile)."""
        round_id, plan_sha256 = work.plan.round_id, work.plan_sha256
        if not self.logs_decryption or (round_id, plan_sha256) in self.decrypting:
            return ""
        call, federation, me = self._rpc().call, self.config.federation_id, self.config.site_id
        signature = signatures.sign_fields(
            self.identity,
            context=DECRYPTING_CONTEXT,
            fields=decrypting_signed_fields(
                federation=federation, decryptor=me, round_id=round_id, plan_sha256=plan_sha256
            ),
        )
        statement = decrypting_statement(
            federation=federation,
            decryptor=me,
            round_id=round_id,
            plan_sha256=plan_sha256,
            signature=signature,
        )
        what = f"this decryptor's decrypting statement of round {round_id}"
        try:
            call("RecordDecrypting", pb.Decrypting(statement=statement))
        except CoordinatorRefused:
            raise
        except DaemonError as exc:
            raise DaemonError(
                f"the coordinator did not log {what} ({exc}): nothing decrypted"
            ) from exc
        t = self.config.timing
        problem, checkpoint = self.log_witness.quorum_problem(
            call,
            statement=statement,
            what=what,
            wait_s=t.upload_timeout_s,
            poll_s=min(t.poll_interval_s, QUORUM_POLL_S),
            max_poll_s=t.max_poll_interval_s,
            with_entries=True,  # read below
        )
        if problem or checkpoint is None:
            raise DaemonError(f"{problem}: nothing decrypted")
        mine = decode_statement(statement, federation=federation)[1]
        for kind, fields in self.log_witness.statements(call, checkpoint):
            if kind == "decrypting" and dict(fields) == mine:
                break
            if kind == "round-aborted" and fields.get("round_id") == round_id:
                return (
                    f"the federation log records round {round_id} as aborted before this "
                    "decryptor's decrypting statement: it decrypts no sum of an aborted round"
                )
        self.decrypting.add((round_id, plan_sha256))
        return ""

    def _serve_job(self, work: RoundDecryptor, round_id: str, job: pb.DecryptionJob) -> None:
        """One job: download the aggregate, decrypt it (or refuse), upload the result, report
        the signed outcome. Jobs run on :data:`JOB_WORKERS` threads, so one job's transfers
        overlap another's decryption; the decryptions themselves take turns
        (:attr:`RoundDecryptor.turn`)."""
        rpc = self._rpc()
        t0 = time.perf_counter()
        aggregate = rpc.download(
            pb.DownloadRequest(
                round_id=round_id,
                kind=pb.PAYLOAD_KIND_CKKS_AGGREGATE,
                release_name=job.release_name,
            )
        )
        t1 = time.perf_counter()
        with work.turn:  # decrypt_s: this job's decryption, not its wait for another's
            t2 = time.perf_counter()
            status, reason, result = work.decrypt(job, aggregate)
            decrypt_s = time.perf_counter() - t2
        self._record(
            round_id=round_id, release=job.release_name, status=status,
            download_s=t1 - t0, decrypt_s=decrypt_s, size=len(aggregate),
        )  # fmt: skip
        digest = hashlib.sha256(result).digest() if result else b""
        if result:
            rpc.upload(
                result,
                round_id=round_id,
                release_name=job.release_name,
                kind=pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE,
            )
        release = work.releases.get(job.release_name)
        grid = release.encoding.ckks.grid_step if release is not None else 0.0
        rpc.call(
            "ReportDecryption",
            self.outcome(
                round_id, work.plan_sha256, job.release_name, status, reason, digest, grid
            ),
        )
        log.info("decryptor: %s %s", job.release_name, pb.DecryptionStatus.Name(status))  # type: ignore[arg-type]

    def _refuse(self, jobs: pb.DecryptionJobs, plan_sha: bytes, reason: str) -> None:
        """Report a signed ``REFUSED_PLAN`` outcome for each job of a plan this decryptor
        refuses (bound to ``plan_sha``, the digest of the plan the jobs carry); no key is
        used."""
        log.warning("decryptor: %s (reported to the coordinator)", reason)
        status = pb.DECRYPTION_STATUS_REFUSED_PLAN
        for job in jobs.jobs:
            outcome = self.outcome(
                jobs.round_id, plan_sha, job.release_name, status, reason, b"", 0
            )
            try:
                self._rpc().call("ReportDecryption", outcome)
            except CoordinatorRefused:
                raise
            except RemoteCallError as exc:  # e.g. the round aborted at the first refusal
                log.info("decryptor: refusal of %s not reported: %s", job.release_name, exc)
                return

    def _record(self, **fields: Any) -> None:
        """Append one job's timing to ``state_dir/ckks/decryptions.jsonl`` (no values)."""
        fields["status"] = pb.DecryptionStatus.Name(fields["status"])
        path = self.config.state_dir / "ckks" / "decryptions.jsonl"
        with self._recording:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(fields) + "\n")

    def outcome(
        self,
        round_id: str,
        plan_sha256: bytes,
        release: str,
        status: int,
        reason: str,
        digest: bytes,
        grid: float,
    ) -> pb.DecryptionOutcome:
        """The signed DecryptionOutcome (context "decryption": bound to the federation, the
        round and its plan's digest)."""
        signature = signatures.sign_fields(
            self.identity,
            context=DECRYPTION_CONTEXT,
            fields=decryption_fields(
                federation_id=self.config.federation_id,
                round_id=round_id,
                plan_sha256=plan_sha256,
                release_name=release,
                status=status,
                result_sha256=digest,
            ),
        )
        return pb.DecryptionOutcome(
            round_id=round_id,
            release_name=release,
            status=status,  # type: ignore[arg-type]
            reason=reason[:300],
            result_sha256=digest,
            grid_step=grid,
            signature=signature,
        )

    def _wait(self, published: bool) -> None:
        """Until the next round event (a round reaching SOLVING has jobs), by the ``WatchRounds``
        stream once enrolled; polling every ``poll_interval_s`` while the stream is down, and
        every ``max_poll_interval_s`` as a safety net while it is up."""
        timing, rpc = self.config.timing, self._rpc()
        watcher = rpc.watch() if published else None
        if watcher is not None and watcher.connected:
            watcher.wait(timing.max_poll_interval_s)
        else:
            time.sleep(timing.poll_interval_s)

    def run(self) -> int:
        """Serve until stopped (or ``max_idle_s`` without jobs); exit code 0. The decryptor waits
        for the coordinator like the sites do: enrolment and every poll are retried while the
        server is unreachable, and a failed job is retried at the next poll."""
        with connect(self.config, insecure=self.insecure) as channel:
            self.rpc = CoordinatorClient(
                pb_grpc.CoordinatorStub(channel),
                site_id=self.config.site_id,
                timing=self.config.timing,
                retry=self.retry,
                metadata=self.metadata,
            )
            idle_since = time.monotonic()
            published, again = False, False
            try:
                while True:
                    handled = 0
                    try:
                        if not published:
                            self.enroll_and_publish()
                            published = True
                        self.witness()
                        handled = self.serve_once()
                    except (CoordinatorRefused, SplitViewDetected):
                        raise  # the coordinator refuses its state (M-143), or showed a split view
                    except DaemonError as exc:
                        log.warning("decryptor: %s (retrying)", exc)
                    if handled:
                        idle_since = time.monotonic()
                        again = not again
                        if again:
                            continue  # the next jobs may be due already: look once more at once
                    elif (
                        self.max_idle_s is not None
                        and time.monotonic() - idle_since > self.max_idle_s
                    ):
                        return 0
                    self._wait(published)
            finally:
                self.rpc.close()
