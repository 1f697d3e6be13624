"""A coordinator that attacks its own sites: the real ``afl-server`` with parts of
:mod:`afl.server` patched at run time (the malicious coordinator of docs/protocol.md §2).

Usage: ``python malicious_server.py ATTACK LOOT <afl-server arguments>``. LOOT is a JSON file
where the coordinator writes every release it managed to decrypt or unmask ({release: values}):
what the attacker learned. The attacks (the victim is site-1; site-2 and site-3 are the other
members of the targeted release):

* ``forward-single`` (ckks): the "sum" of ``gram[all]`` handed to the decryptor is site-1's
  ciphertext alone.
* ``forged-tags`` (ckks): the same, and the coordinator replaces site-2's and site-3's sealed
  aggregate tags by tags it sealed itself to the decryptor (+1000 and -1000, so the tag sum is
  site-1's tag, the tag slot of its ciphertext), exactly as the tags travelled before sites
  signed them.
* ``lower-threshold`` (mask): the signed plan gives ``b[A]`` (members site-1..3) the survivor
  threshold t_R = 1, and the coordinator ignores the masked inputs of site-2 and site-3, so the
  unmasked "sum" of ``b[A]`` is site-1's own class vector.
* ``swap-keys`` (mask): the operator who runs the coordinator (and holds the federation CA, but
  not site-1's identity key, which stays in site-1's kit) replaces site-1's advertised key-agreement
  keys in the directory it hands the other sites by keys of its own, signed with a key it made
  (it cannot sign as site-1): with them it could strip site-1's pairwise masks.
* ``evaluate-unverified`` (mask, a run with ``evaluate = true``): the evaluation plan names a
  crafted model no round published, whose W is a unit vector per class (scoring a site's rows with
  it would release the histogram of one feature).
* ``isolate-site`` (mask, ``evaluate = true``): the evaluation plan adds to the honest releases a
  histogram over every participant but the first (the victim, site-1 in the first plan), and the
  coordinator's own audit is patched to look away: the difference is the victim's histogram.
* ``crafted-model-dp`` (mask, a DP run with ``evaluate = true``): the coordinator publishes, signed
  as the run's model, a crafted W whose column c is the unit vector e_j (j = 0, 3: two raw
  features) instead of the solved one, and gives the DP evaluation round the fine default grid
  (1,284 bins) instead of the DP bins: the sites verified the model (it is the published result
  of a round they took part in), so they score it; what comes back is DP-noised.
* ``split-view`` (any mode): the coordinator shows two histories. Sites ``SPLIT_GROUP`` see a
  forged federation log in which every plan statement is replaced (checkpoints the coordinator
  signs, the consistency and inclusion proofs they carry and the entries of the forged tree,
  their cosignatures kept apart), the
  others see the true log; once a site of the group cosigned a forged checkpoint, it is shown the
  true one (the coordinator needs its cosignature for a quorum).
* ``misstate-release`` (mask): the federation log's `release` statement of a published round
  names one survivor fewer than the sums hold (the last site): every other site's whole-history
  audit would then count that site's statistics as never released.
* ``hide-release`` (mask): run-1's masked round's sums are unmasked (kept in LOOT as
  ``<run>/<round>/<release>``, as every later round's), then the round is aborted without the
  `release` statement the honest coordinator logs for an aborted round whose sums it decoded
  (``"published": false``): the coordinator's books show the round as never released, so a
  later run over fewer sites would difference to the missing ones' statistics. Later runs are
  served honestly.
* ``reuse-round-id`` (mask): the first round of a later run takes the id of an earlier run's
  published round (the coordinator renames the old round's rows in its own database), and the
  coordinator skips its own history audits (M-124: at submission, at plan time and before
  unmasking), as if the two rounds were one release; unmasked sums go to LOOT as
  ``<run>/<round>/<release>``.
* ``hide-release-ckks`` (ckks): the same as ``hide-release`` in a CKKS federation: run-1's
  round is decrypted (every release's sum kept in LOOT as ``<run>/<round>/<release>``), then
  aborted with no `release` statement; later runs are served honestly.
* ``refuse-opening`` (any mode): the coordinator logs no `opening` statement (RecordOpening
  is refused, and so is a consistency signature that carries one), so the openings every site
  logs before its statistics (ckks) or unmask shares (mask) never reach the log.
* ``drop-opening`` (mask): the coordinator answers every `opening` as logged but appends none,
  and keeps the consistency signatures that carry them: the unmask stage begins without them.
* ``fake-release`` (mask): once run-1's round is published, the coordinator also logs a
  `release` statement of a round that never existed (run-0), stating run-1's releases over
  the last site alone: every later audit would count that site's statistics as exposed before,
  so a plan that really differences them out would not be blamed for it. The coordinator skips
  its own history audits (M-124); unmasked sums go to LOOT as ``<run>/<round>/<release>``.
* ``unwitness-fake-release`` (mask): ``fake-release``, and the coordinator also refuses to log
  the last site's (site-5's) `opening` statements: site-5 stops before its consistency
  signature, but its masked input is already in U3, and the round is unmasked over U3 with the
  other survivors' signatures (t of them suffice), so run-1's release is real and no longer
  witnessed by every survivor (M-233). The consistency stage closes without waiting for
  site-5's signature.
* ``drop-at-upload`` (mask): the coordinator refuses site-8's masked input (as if it dropped
  out; site-8 takes part in run-3 only) and closes the upload stage without it, so run-3's round is unmasked over the
  other participants; it skips its own history audits (M-124, before unmasking too); unmasked
  sums go to LOOT as ``<run>/<round>/<release>``.
* ``skip-review-ckks`` (ckks): ``hide-release-ckks``, and the coordinator tells run-3's
  participants that they already accepted its plan (``RoundStatus.caller_accepted_plan``, from
  decisions it makes up for them), so its round opens its upload stage at once: a site that
  believes it (a site restarted after it accepted) skips the plan's log check and its
  whole-history audit (docs/protocol.md M-193, M-206).
* ``abort-then-decrypt`` (ckks): once run-1's round has every upload, the coordinator logs the
  round's `round-aborted` statement (every site's audit would then count its sums as never
  released, M-235) and still hands its sums to the decryptor; what comes back decrypted goes
  to LOOT.
* ``weaken-graph`` (mask, sparse graph): the signed plan's masking graph has degree k = 2 and
  neighbourhood threshold t_N = 2 (two colluding neighbours would unmask a site), with the
  failure probability those numbers give stated truthfully.

The faults are injected here, around the real daemon, so no product code path knows them; the
sites and the decryptor run unmodified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.crypto import aead, kdf
from afl.crypto.canonical import DOMAIN_TAG
from afl.crypto.identity.signatures import sign_fields
from afl.crypto.secagg.graph_bounds import (
    colluders_for,
    dropouts_for,
    failure_probability,
    log2_probability,
)
from afl.crypto.secagg.messages import ADVERTISE_CONTEXT, advert_fields
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.daemon import main as daemon
from afl.server.errors import InvalidRequestError
from afl.server.modes.ckks import CkksMode, CkksRequests
from afl.server.modes.mask import MaskMode, MaskRequests
from afl.server.plan import open as plan_open
from afl.server.solve.model import build_signed_model

VICTIM = "site-1"
OTHERS = ("site-2", "site-3")
CKKS_TARGET = "gram[all]"
MASK_TARGET = "b[A]"
ATTACKS = (
    "forward-single",
    "forged-tags",
    "lower-threshold",
    "swap-keys",
    "evaluate-unverified",
    "isolate-site",
    "weaken-graph",
    "crafted-model-dp",
    "split-view",
    "misstate-release",
    "hide-release",
    "reuse-round-id",
    "fake-release",
    "hide-release-ckks",
    "refuse-opening",
    "drop-opening",
    "unwitness-fake-release",
    "drop-at-upload",
    "skip-review-ckks",
    "abort-then-decrypt",
)
#: The raw features the crafted DP model's columns read (w_c = e_j).
CRAFTED_FEATURES = (0, 3)
#: The sites ``split-view`` first shows the forged log.
SPLIT_GROUP = ("site-3", "site-4")
#: The feature dimension of the crafted model (the adversarial tests' d).
FORGED_D = 8
#: The coordinator's extra release of ``isolate-site``.
ISOLATING = "eval_hist[without the first]"


def command(attack: str, loot: Path) -> tuple[str, ...]:
    """The argv prefix that starts this coordinator (for ``run_loopback(server_command=...)``)."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}")
    return (sys.executable, str(Path(__file__).resolve()), attack, str(loot))


def _keep(loot: Path, name: str, values: Any) -> None:
    found = json.loads(loot.read_text()) if loot.exists() else {}
    found[name] = [float(v) for v in np.ravel(np.asarray(values, dtype=np.float64))]
    loot.write_text(json.dumps(found))


def _record_decryptions(loot: Path) -> None:
    original = CkksMode.accept_result

    def accept_result(
        self: CkksMode, view: Any, ctx: Any, release: Any, outcome: pb.DecryptionOutcome
    ) -> None:
        data = self.round_state(view, ctx).staged_results.get(release.name, b"")
        original(self, view, ctx, release, outcome)
        if outcome.status == pb.DECRYPTION_STATUS_DECRYPTED:
            _keep(loot, release.name, np.frombuffer(data, dtype="<f8"))

    CkksMode.accept_result = accept_result  # type: ignore[method-assign]


def _forward_single() -> None:
    original = CkksMode.aggregate

    def aggregate(self: CkksMode, view: Any, ctx: Any, release: Any) -> bytes:
        if release.name != CKKS_TARGET:
            return original(self, view, ctx, release)
        state = self.round_state(view, ctx)
        victim = ctx.uploads(view.round_id)[(VICTIM, release.name)]
        state.aggregates[release.name] = ctx.read_payload(victim)  # c_1 alone, as "the sum"
        return state.aggregates[release.name]

    CkksMode.aggregate = aggregate  # type: ignore[method-assign]


def _sealed_by_the_coordinator(
    sender: str, plan: cpb.ReleasePlan, announcement: pb.CkksContextAnnouncement, value: float
) -> pb.SealedMessage:
    """AggregateTags "from" ``sender`` with every slot's tag = ``value``, sealed to the decryptor
    with an ephemeral key (all the coordinator needs is the decryptor's public tag key)."""
    message = pb.AggregateTags(
        round_id=plan.round_id,
        site_id=sender,
        tags=[
            pb.TagValue(upload_name=r.upload_name or r.name, value=value)
            for r in plan.releases
            if sender in r.member_site_ids
        ],
    )
    decryptor = announcement.decryptor_site_id
    ephemeral = kdf.generate_agreement_key()
    key = kdf.derive_key(
        shared_secret=kdf.agree(ephemeral, bytes(announcement.cipher_public_key)),
        round_salt=bytes(plan.round_salt),
        purpose="ckks-tags",
        round_id=plan.round_id,
        release="",
        binding=(sender, decryptor),
    )
    blob = aead.seal(
        key,
        message.SerializeToString(),
        associated=(DOMAIN_TAG, "ckks-tags", sender, decryptor, plan.round_id),
    )
    return pb.SealedMessage(
        sender_site_id=sender,
        recipient_site_id=decryptor,
        sender_public_key=kdf.public_key_bytes(ephemeral),
        ciphertext=blob,
    )


def _forge_tags() -> None:
    original = CkksRequests.get_tags

    def get_tags(self: CkksRequests, site_id: str, request: cpb.RoundRef) -> pb.SealedMessages:
        honest = original(self, site_id, request)
        with self.access.lock:
            view = self.access.find(honest.round_id)
            plan = cpb.ReleasePlan.FromString(view.row.plan or b"")
            announcement = self.contexts.context().announcement
        forged = {
            OTHERS[0]: _sealed_by_the_coordinator(OTHERS[0], plan, announcement, 1000.0),
            OTHERS[1]: _sealed_by_the_coordinator(OTHERS[1], plan, announcement, -1000.0),
        }
        messages = [forged.get(m.sender_site_id, m) for m in honest.messages]
        return pb.SealedMessages(round_id=honest.round_id, messages=messages)

    CkksRequests.get_tags = get_tags  # type: ignore[method-assign]


def _record_unmasked(loot: Path, *, by_round: bool = False) -> None:
    """Keep every sum the masked exchange unmasks (what the coordinator learned), named by the
    release (``by_round``: ``<run>/<round>/<release>``)."""
    drive = MaskMode.drive

    def keeping(self: MaskMode, view: Any, ctx: Any) -> Any:
        state = self.rounds.get(view.round_id)
        transition = drive(self, view, ctx)
        result = None if state is None else state.server.result
        prefix = f"{view.row.run_id}/{view.round_id}/" if by_round else ""
        for name, values in ({} if result is None else result.sums).items():
            _keep(loot, prefix + name, values)
        return transition

    MaskMode.drive = keeping  # type: ignore[method-assign]


def _lower_threshold(loot: Path) -> None:
    encoding, check_upload = MaskMode.encoding, MaskMode.check_upload

    def lowered(self: MaskMode, release: Any, **kw: Any) -> cpb.Encoding:
        out = encoding(self, release, **kw)
        if release.name == MASK_TARGET:
            out.fixed_point.min_survivors = 1
        return out

    def ignoring(self: MaskMode, view: Any, ctx: Any, *, site_id: str, **kw: Any) -> None:
        if site_id in OTHERS:
            raise InvalidRequestError("masked input refused")  # the coordinator drops them
        check_upload(self, view, ctx, site_id=site_id, **kw)

    MaskMode.encoding = lowered  # type: ignore[method-assign]
    MaskMode.check_upload = ignoring  # type: ignore[method-assign]
    _record_unmasked(loot)


def _swap_keys(loot: Path) -> None:
    original = MaskRequests.advertised_keys
    attacker = Ed25519PrivateKey.generate()  # the operator's own key: not site-1's identity key

    def advertised_keys(self: MaskRequests, site: str, round_id: str) -> pb.AdvertisedKeys:
        directory = original(self, site, round_id)
        if site == VICTIM:
            return directory  # the victim sees its own keys: it notices nothing
        with self.access.lock:
            row_plan = self.access.find(directory.round_id).row.plan or b""
        plan = cpb.ReleasePlan.FromString(row_plan)  # the round's own plan: only the key is forged
        config = wire.round_config_from_plan(plan, plan_sha256=hashlib.sha256(row_plan).digest())
        for entry in directory.keys:
            if entry.site_id == VICTIM:
                enc, mask = kdf.generate_agreement_key(), kdf.generate_agreement_key()
                entry.cipher_public_key = kdf.public_key_bytes(enc)
                entry.mask_public_key = kdf.public_key_bytes(mask)
                fields = advert_fields(
                    config,
                    site_id=VICTIM,
                    enc_public=bytes(entry.cipher_public_key),
                    mask_public=bytes(entry.mask_public_key),
                )
                entry.signature = sign_fields(attacker, context=ADVERTISE_CONTEXT, fields=fields)
        return directory

    MaskRequests.advertised_keys = advertised_keys  # type: ignore[method-assign]
    _record_unmasked(loot)


def _evaluate_unverified() -> None:
    """The evaluation plan names a crafted model that no round published."""
    original = vars(plan_open)["evaluation_releases"]  # the name open_plan calls

    def crafted(*, classes: Any, participants: Any, model_sha256: bytes, **kw: Any) -> Any:
        weights = np.zeros((FORGED_D, len(classes)))
        weights[np.arange(len(classes)) % FORGED_D, np.arange(len(classes))] = 1.0  # w_c = e_c
        forged = build_signed_model(
            weights,
            identity_key=Ed25519PrivateKey.generate(),  # no site ever receives it
            federation_id="",
            round_id="never-published",
            round_number=1,
            classes=list(classes),
            gamma=1.0,
            backbone="",
            contributors=[],
            plan_bytes=b"",
        )
        digest = hashlib.sha256(forged.model).digest()
        return original(classes=classes, participants=participants, model_sha256=digest, **kw)

    vars(plan_open)["evaluation_releases"] = crafted


def _publish_crafted() -> None:
    """The DP run's solve returns W = [e_0, e_3] and the evaluation bins are the fine grid."""
    from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
    from afl.server.solve import publish

    def crafted(plan_bytes: bytes, sums: Any, *, classes: Any, **kw: Any) -> Any:
        weights = np.zeros((FORGED_D, len(classes)))
        for c in range(len(classes)):
            weights[CRAFTED_FEATURES[c % len(CRAFTED_FEATURES)], c] = 1.0
        return weights

    vars(publish)["solve_dp_run"] = crafted
    vars(plan_open)["dp_evaluation_bins"] = lambda model, **kw: DEFAULT_SCORE_BINS


def _isolate_site() -> None:
    """An extra histogram over all participants but the first; the coordinator's audit of it
    is patched away (the honest coordinator would not open such a plan)."""
    original, audit = vars(plan_open)["evaluation_releases"], vars(plan_open)["audit_plan"]

    def isolating(*, classes: Any, participants: Any, model_sha256: bytes, **kw: Any) -> Any:
        releases = original(
            classes=classes, participants=participants, model_sha256=model_sha256, **kw
        )
        others = tuple(sorted(participants))[1:]
        extra = dataclasses.replace(releases[0], name=ISOLATING, members=others)
        return [*releases, extra]

    def looking_away(releases: Any, participants: Any, **kw: Any) -> Any:
        return audit([r for r in releases if r.name != ISOLATING], participants, **kw)

    vars(plan_open)["evaluation_releases"] = isolating
    vars(plan_open)["audit_plan"] = looking_away


def _weaken_graph() -> None:
    def weak(self: MaskMode, n: int) -> cpb.MaskGraph:
        colluders = colluders_for(n, self.mask.colluder_fraction)
        dropouts = dropouts_for(n, self.mask.dropout_fraction)
        p = failure_probability(
            n=n, degree=2, share_threshold=2, colluders=colluders, dropouts=dropouts
        )
        return cpb.MaskGraph(
            degree=2,
            share_threshold=2,
            colluders=colluders,
            dropouts=dropouts,
            failure_log2=log2_probability(p),
        )

    MaskMode.sparse_graph = weak  # type: ignore[method-assign]


def _split_view() -> None:
    from afl.crypto.transparency.checkpoint import Checkpoint, Cosignature, sign_checkpoint
    from afl.crypto.transparency.merkle import (
        consistency_proof,
        inclusion_proof,
        leaf_hash,
        root_hash,
    )
    from afl.crypto.transparency.statements import decode_statement, plan_statement
    from afl.server.coordinator import Coordinator
    from afl.server.transparency import CosignedCheckpoint, FederationLog, cosigned_to_proto

    forged_cosigs: dict[tuple[int, bytes], dict[str, Any]] = {}
    cosigned_forged: set[str] = set()

    def forged_entries(
        log: FederationLog, start: int, end: int
    ) -> list[tuple[int, str, bytes, int]]:
        """The log as the split group is shown it: every plan statement names another plan (a
        consistent forged log, whose entries hash to the forged checkpoints)."""
        out = []
        for index, kind, entry, stamp in log.store.log_entries(start, end):
            if kind == "plan":
                fields = decode_statement(entry, federation=log.federation_id)[1]
                forged = hashlib.sha256(b"forged" + bytes.fromhex(str(fields["plan_sha256"])))
                entry = plan_statement(
                    federation=log.federation_id,
                    round_id=str(fields["round_id"]),
                    plan_sha256=forged.digest(),
                )
            out.append((index, kind, entry, stamp))
        return out

    def forged_leaves(log: FederationLog, size: int) -> list[bytes]:
        return [leaf_hash(entry) for _, _, entry, _ in forged_entries(log, 0, size)]

    def forged_view(self: Coordinator, site_id: str) -> bool:
        """A site of the group is shown the forged log from the first plan on, until it cosigned
        a forged checkpoint; then the true one (the coordinator needs its cosignature for a
        quorum)."""
        if site_id not in SPLIT_GROUP or site_id in cosigned_forged:
            return False
        return any(k == "plan" for _, k, _, _ in self.store.log_entries(0, self.store.log_size()))

    honest_checkpoint = Coordinator.log_checkpoint
    honest_consistency = Coordinator.log_consistency
    honest_entries = Coordinator.log_entries
    honest_cosign = Coordinator.log_cosign

    def log_checkpoint(
        self: Coordinator, site_id: str, request: pb.CheckpointRequest | None = None
    ) -> Any:
        """The forged checkpoint with the proofs the site asks for, in the forged log (they
        verify there: the attack is the two views, not a broken proof)."""
        if not forged_view(self, site_id):
            answer = honest_checkpoint(self, site_id, request)
            # A held answer is computed afresh when it ends, perhaps after the plan was logged:
            # a group site must not see the true checkpoint that holds it (it would cosign it
            # and complete the honest sites' quorum), so it is answered the forged one instead.
            if not forged_view(self, site_id):
                return answer
        request = request or pb.CheckpointRequest()
        with self.lock:
            n = int(request.size) or self.store.log_size()
            leaves = forged_leaves(self.log, n)
            root = root_hash(leaves)
            signed = sign_checkpoint(self.log._key, Checkpoint(self.log.federation_id, n, root))
            cosigs = tuple(forged_cosigs.get((n, root), {}).values())
        since, wanted = int(request.consistency_from), bytes(request.inclusion_leaf)
        index = leaves.index(wanted) if wanted in leaves else None
        return cosigned_to_proto(
            CosignedCheckpoint(signed, cosigs),
            consistency=consistency_proof(leaves, since) if 0 < since < n else [],
            inclusion=None if index is None else (index, inclusion_proof(leaves, index)),
        )

    def log_consistency(self: Coordinator, site_id: str, old_size: int, new_size: int) -> Any:
        if not forged_view(self, site_id):
            return honest_consistency(self, site_id, old_size, new_size)
        with self.lock:
            leaves = forged_leaves(self.log, new_size)
            return pb.LogProof(hashes=consistency_proof(leaves, old_size))

    def log_entries(self: Coordinator, site_id: str, start: int, end: int) -> Any:
        # Always the forged entries to the group: a site shown the true checkpoint after its
        # forged cosignature stops at that checkpoint, before it reads any entry.
        if site_id not in SPLIT_GROUP:
            return honest_entries(self, site_id, start, end)
        with self.lock:
            rows = forged_entries(self.log, start, end)
        return pb.LogEntries(
            entries=[
                pb.LogEntry(index=i, kind=kind, statement=entry, time_unix_ms=stamp)
                for i, kind, entry, stamp in rows
            ]
        )

    def log_cosign(self: Coordinator, site_id: str, request: pb.LogCosignature) -> Any:
        with self.lock:
            signed = self.log.store.log_checkpoint(int(request.size))
        if signed is not None and signed[1] == bytes(request.root):
            return honest_cosign(self, site_id, request)
        checkpoint = Checkpoint(self.log.federation_id, int(request.size), bytes(request.root))
        key = (checkpoint.size, checkpoint.root)
        forged_cosigs.setdefault(key, {})[site_id] = Cosignature(
            site_id, checkpoint, bytes(request.signature)
        )
        cosigned_forged.add(site_id)
        forged = sign_checkpoint(self.log._key, checkpoint)
        return cosigned_to_proto(CosignedCheckpoint(forged, tuple(forged_cosigs[key].values())))

    Coordinator.log_checkpoint = log_checkpoint  # type: ignore[method-assign]
    Coordinator.log_consistency = log_consistency  # type: ignore[method-assign]
    Coordinator.log_entries = log_entries  # type: ignore[method-assign]
    Coordinator.log_cosign = log_cosign  # type: ignore[method-assign]


def _misstate_release() -> None:
    from afl.server.rounds import RoundMachine

    honest = RoundMachine._release_fields

    def misstated(self: RoundMachine, view: Any, *, decoded: Any = None) -> dict[str, object]:
        fields = honest(self, view, decoded=decoded)
        survivors = fields["survivors"]
        assert isinstance(survivors, list)
        return {**fields, "survivors": survivors[:-1]}

    RoundMachine._release_fields = misstated  # type: ignore[method-assign]


def _hide_release(loot: Path) -> None:
    """A round whose sums were unmasked is aborted, and nothing of it is released in the log."""
    from afl.server.modes.base import Transition

    _record_unmasked(loot, by_round=True)
    drive = MaskMode.drive  # the keeping one

    def hiding(self: MaskMode, view: Any, ctx: Any) -> Any:
        transition = drive(self, view, ctx)
        if transition is None or transition.stage != pb.ROUND_STAGE_SOLVING:
            return transition
        if view.row.run_id != "run-1":
            return transition
        # The honest coordinator would solve and log the release (or, aborting, note what it
        # decoded so that the abort logs it): neither happens.
        return Transition(pb.ROUND_STAGE_ABORTED, reason="aborted after unmasking")

    MaskMode.drive = hiding  # type: ignore[method-assign]


def _hide_release_ckks(loot: Path) -> None:
    """A CKKS round whose sums were decrypted is aborted, and nothing of it is released."""
    from afl.core.aggregation import AggregationError

    honest = CkksMode.sums

    def hiding(self: CkksMode, view: Any, ctx: Any) -> Any:
        sums = honest(self, view, ctx)
        if sums is None:
            return sums
        for name, values in sums.items():
            _keep(loot, f"{view.row.run_id}/{view.round_id}/{name}", values)
        if view.row.run_id != "run-1":
            return sums
        # The honest coordinator would solve and log the release: neither happens.
        raise AggregationError("aborted after decrypting")

    CkksMode.sums = hiding  # type: ignore[method-assign]


def _abort_then_decrypt() -> None:
    """Run-1's CKKS round is logged as aborted as it reaches SOLVING, and decrypted all the same."""
    from afl.server.modes.ckks import CkksRequests

    jobs = CkksRequests.jobs
    logged: set[str] = set()

    def aborted_first(self: CkksRequests, site_id: str, request: Any) -> Any:
        with self.access.lock:  # the answer's jobs leave only after the abort is logged
            answer = jobs(self, site_id, request)
            if answer.jobs and answer.round_id not in logged:
                view = self.access.find(answer.round_id)
                if view.row.run_id == "run-1":
                    self.access.store.append_log(
                        "round-aborted", {"round_id": view.round_id, "reason": "a site was lost"}
                    )
                    logged.add(view.round_id)
            return answer

    CkksRequests.jobs = aborted_first  # type: ignore[method-assign]


def _accepted_for_them(run_id: str) -> None:
    """Every participant of ``run_id``'s rounds has accepted their plan, says the coordinator."""
    from afl.server.store import Store

    decisions, decision = Store.decisions, Store.decision

    def ours(store: Store, round_id: str) -> bool:
        row = store.round(round_id)
        return row is not None and row.run_id == run_id

    def made_up(self: Store, round_id: str) -> dict[str, tuple[bool, str]]:
        if not ours(self, round_id):
            return decisions(self, round_id)
        row = self.round(round_id)
        assert row is not None
        return {s: (True, "") for s in row.participants}

    def one(self: Store, round_id: str, site_id: str) -> tuple[bool, str] | None:
        return (True, "") if ours(self, round_id) else decision(self, round_id, site_id)

    Store.decisions = made_up  # type: ignore[method-assign]
    Store.decision = one  # type: ignore[method-assign]


def _drop_opening() -> None:
    """The coordinator logs no `opening` statement but answers as if it had, so a masked
    round's consistency signatures, which carry them, are kept."""
    from afl.server.coordinator import Coordinator

    def dropping(self: Coordinator, site_id: str, request: Any, **kw: Any) -> Any:
        return pb.LogProof(index=0)

    Coordinator.log_opening = dropping  # type: ignore[method-assign]


def _refuse_opening(only: str = "") -> None:
    """The coordinator logs no `opening` statement (``only``: none of that site's)."""
    from afl.server.coordinator import Coordinator

    honest = Coordinator.log_opening

    def refusing(self: Coordinator, site_id: str, request: Any, **kw: Any) -> Any:
        if not only or site_id == only:
            raise InvalidRequestError("this coordinator logs no openings")
        return honest(self, site_id, request, **kw)

    Coordinator.log_opening = refusing  # type: ignore[method-assign]


def _skip_history_audits() -> None:
    """The coordinator's own audits of the federation's history (M-124) look away."""
    from afl.server import runs
    from afl.server.modes import context
    from afl.server.rounds import RoundMachine

    RoundMachine.exposes_history = lambda self, *a, **kw: ""  # type: ignore[method-assign]
    for module in (plan_open, context):  # the name each imported
        setattr(module, "history_audit", lambda *a, **kw: ("", None))  # noqa: B010
    setattr(runs, "submission_audit", lambda *a, **kw: ("", None))  # noqa: B010


def _rename_round(store: Any, old: str, new: str) -> None:
    """``old``'s rows in every table of the coordinator's database are ``new``'s (the federation
    log keeps its statements: it is append-only, and its entries are what sites verify)."""
    with store.transaction() as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            columns = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
            if "round_id" in columns:
                db.execute(f"UPDATE {table} SET round_id = ? WHERE round_id = ?", (new, old))


def _reuse_round_id(loot: Path) -> None:
    """The first round of a later run is given the id of an earlier run's published round."""
    from afl.server.rounds import RoundMachine

    _record_unmasked(loot, by_round=True)
    _skip_history_audits()
    honest = RoundMachine._new_round
    reused: list[str] = []

    def reusing(self: RoundMachine, run: Any, **kw: Any) -> Any:
        view = honest(self, run, **kw)
        published = [
            r.round_id
            for r in self.store.rounds()
            if r.run_id != run.run_id and r.stage == pb.ROUND_STAGE_PUBLISHED
        ]
        if reused or not published:
            return view
        target = published[0]
        reused.append(target)
        with self.announcer.transition():
            _rename_round(self.store, target, f"{target}-old")
            _rename_round(self.store, view.round_id, target)
            self._emit(target)
        return self.find(target)

    RoundMachine._new_round = reusing  # type: ignore[method-assign]


def _fake_release(loot: Path) -> None:
    """A made-up round's release statement, over one site alone, after run-1's round."""
    from afl.server.rounds import RoundMachine

    _record_unmasked(loot, by_round=True)
    _skip_history_audits()
    honest = RoundMachine._log_stage
    faked: list[str] = []

    def faking(self: RoundMachine, view: Any, stage: int, *, reason: str, detail: Any) -> None:
        honest(self, view, stage, reason=reason, detail=detail)
        if faked or not detail or view.row.run_id != "run-1":
            return
        fields = self._release_fields(view)
        survivors = fields["survivors"]
        assert isinstance(survivors, list)
        faked.append(view.round_id)
        self.store.append_log(
            "release",
            {
                **fields,
                "round_id": f"{view.round_id}-made-up",
                "run_id": "run-0",
                "survivors": survivors[-1:],
            },
        )

    RoundMachine._log_stage = faking  # type: ignore[method-assign]


def _refuse_last_opening() -> None:
    """The coordinator does not log site-5's `opening` statements, and closes the consistency
    check without waiting for its signature."""
    _refuse_opening(only="site-5")
    close = MaskMode._close

    def closing(stage: int, state: Any) -> int:
        following = close(stage, state)
        if following == pb.ROUND_STAGE_CONSISTENCY_CHECK:
            state.expected.discard("site-5")  # no wait for the signature it cannot send
        return following

    MaskMode._close = staticmethod(closing)  # type: ignore[method-assign]


def _drop_at_upload(loot: Path) -> None:
    """A round is unmasked without site-8's masked input (site-8 takes part in run-3 only)."""
    _record_unmasked(loot, by_round=True)
    _skip_history_audits()
    check_upload, close = MaskMode.check_upload, MaskMode._close
    dropped = "site-8"

    def ignoring(self: MaskMode, view: Any, ctx: Any, *, site_id: str, **kw: Any) -> None:
        if site_id == dropped:
            raise InvalidRequestError("masked input refused")  # the coordinator drops it
        check_upload(self, view, ctx, site_id=site_id, **kw)

    def closing(stage: int, state: Any) -> int:
        following = close(stage, state)
        if following == pb.ROUND_STAGE_UPLOAD:
            state.expected.discard(dropped)  # no wait for the input it refuses
        return following

    MaskMode.check_upload = ignoring  # type: ignore[method-assign]
    MaskMode._close = staticmethod(closing)  # type: ignore[method-assign]


def main() -> int:
    attack, loot, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if attack in ("forward-single", "forged-tags"):
        _record_decryptions(loot)
        _forward_single()
    if attack == "forged-tags":
        _forge_tags()
    if attack == "lower-threshold":
        _lower_threshold(loot)
    if attack == "swap-keys":
        _swap_keys(loot)
    if attack == "evaluate-unverified":
        _record_unmasked(loot)
        _evaluate_unverified()
    if attack == "isolate-site":
        _record_unmasked(loot)
        _isolate_site()
    if attack == "weaken-graph":
        _weaken_graph()
    if attack == "crafted-model-dp":
        _record_unmasked(loot)
        _publish_crafted()
    if attack == "split-view":
        _split_view()
    if attack == "misstate-release":
        _misstate_release()
    if attack == "hide-release":
        _hide_release(loot)
    if attack == "reuse-round-id":
        _reuse_round_id(loot)
    if attack in ("fake-release", "unwitness-fake-release"):
        _fake_release(loot)
    if attack in ("hide-release-ckks", "skip-review-ckks"):
        _hide_release_ckks(loot)
    if attack == "skip-review-ckks":
        _accepted_for_them("run-3")
    if attack == "refuse-opening":
        _record_decryptions(loot)
        _record_unmasked(loot)
        _refuse_opening()
    if attack == "drop-opening":
        _record_unmasked(loot)
        _drop_opening()
    if attack == "drop-at-upload":
        _drop_at_upload(loot)
    if attack == "unwitness-fake-release":
        _refuse_last_opening()
    if attack == "abort-then-decrypt":
        _record_decryptions(loot)
        _abort_then_decrypt()
    return daemon.main(args)


if __name__ == "__main__":
    sys.exit(main())
