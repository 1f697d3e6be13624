"""Server state machine of secure aggregation (Bonawitz et al. CCS'17; docs/protocol.md §4.2).

Each stage collects client messages with :meth:`SecAggServer.receive` until the driver closes it
(a deadline in a daemon, an explicit call here); clients that sent nothing by then have dropped:

    ADVERTISE     receive AdvertiseKeys from the cohort  → close_advertise()     → U1, KeyDirectory
    SHARE_KEYS    receive ShareKeysUpload from U1        → close_share_keys()    → U2, RoutedShares
    MASKED_INPUT  receive MaskedInputUpload from U2      → close_masked_input()  → U3
    CONSISTENCY   receive ConsistencySignature from U3   → close_consistency()   → U4, UnmaskRequest
    UNMASK        receive UnmaskResponse from U4         → close_unmask()        → U5, SecAggResult

Every close needs at least t live clients, otherwise the round aborts (:class:`RoundAbortedError`,
reason kept in ``abort_reason``) and nothing is released. ``receive`` rejects, with a
:class:`ProtocolError` subclass, a message of the wrong stage, for another round, from a site
outside the cohort or one that dropped at an earlier stage, a duplicate, a body that claims
another sender than the authenticated one, and malformed bodies.

Release rule (see :mod:`afl.crypto.secagg.config`): release R's sum is over S_R = M_R ∩ U3 and
is released iff |S_R| ≥ t_R; otherwise it is withheld (reason in ``SecAggResult.withheld``), its
uploads are discarded and no self-mask share of it is requested.

Memory: a masked input is added into one running sum per release (mod 2^64) as it arrives, so
the server holds O(releases) vectors, not O(sites) (every arrival is in U3).

Sparse graph (``config.graph``): the server is given every participant's graph commitment
(``commitments``, from the signed plan decisions) and refuses an advert whose nonce does not open
it or that was made for another commitment list; AdvertiseKeys closes only with every
participant's advert (the graph is never drawn from a subset of the nonces); it derives the same
graph as the sites (:mod:`afl.crypto.secagg.graph`), takes from each site share bundles for
exactly its neighbours, asks each responder for the shares it holds only, and reconstructs with
the neighbourhood threshold t_N.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from numpy.typing import NDArray

from afl.crypto.canonical import Field
from afl.crypto.errors import (
    CryptoError,
    DuplicateMessageError,
    MaskingError,
    ProtocolError,
    RoundAbortedError,
    RoundMismatchError,
    StageError,
    UnknownParticipantError,
)
from afl.crypto.identity.signatures import verify_fields
from afl.crypto.masking import ring_sum
from afl.crypto.secagg.config import RoundConfig
from afl.crypto.secagg.graph import commitments_digest, derive_graph, graph_commitment, graph_seed
from afl.crypto.secagg.messages import (
    ADVERTISE_CONTEXT,
    CONSISTENCY_CONTEXT,
    AdvertiseKeys,
    ClientMessage,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShare,
    KeyDirectory,
    MaskedInputUpload,
    RoutedShares,
    ShareKeysUpload,
    Stage,
    UnmaskRequest,
    UnmaskResponse,
    consistency_fields,
    signed_advert_fields,
)
from afl.crypto.secagg.unmask import (
    collect_shares,
    expected_reveals,
    reconstruct_mask_keys,
    reconstruct_self_seeds,
    release_sum,
)

__all__ = ["SecAggResult", "SecAggServer"]


_MESSAGE_STAGE: dict[type, Stage] = {
    AdvertiseKeys: Stage.ADVERTISE,
    ShareKeysUpload: Stage.SHARE_KEYS,
    MaskedInputUpload: Stage.MASKED_INPUT,
    ConsistencySignature: Stage.CONSISTENCY,
    UnmaskResponse: Stage.UNMASK,
}


@dataclass(frozen=True, eq=False)
class SecAggResult:
    """Outcome of a completed round: decoded float64 sums of the released releases, who
    contributed to each (M_R ∩ U3), the withheld releases with reasons, and U3 / U2 \\ U3."""

    sums: Mapping[str, NDArray[np.float64]]
    contributors: Mapping[str, tuple[str, ...]]
    withheld: Mapping[str, str]
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


class SecAggServer:
    """The server's side of one round; ``identities`` maps site id → Ed25519 identity key;
    ``commitments`` maps every participant to its graph commitment (sparse graph only)."""

    def __init__(
        self,
        *,
        config: RoundConfig,
        identities: Mapping[str, Ed25519PublicKey],
        commitments: Mapping[str, bytes] | None = None,
    ) -> None:
        missing = set(config.cohort) - set(identities)
        if missing:
            raise ProtocolError(f"no identity key for cohort sites {sorted(missing)}")
        if config.graph is not None and set(commitments or {}) != set(config.cohort):
            raise ProtocolError("a sparse graph needs every participant's graph commitment")
        self.config = config
        self._identities = dict(identities)
        self._commitments = dict(commitments or {}) if config.graph is not None else {}
        self._digest = commitments_digest(self._commitments) if self._commitments else b""
        self.neighbours: dict[str, frozenset[str]] | None = None  # None: the full graph
        self.stage = Stage.ADVERTISE
        self.abort_reason: str | None = None
        self._live: tuple[str, ...] = config.cohort  # senders allowed in the current stage
        self._inbox: dict[str, ClientMessage] = {}
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._u2: tuple[str, ...] = ()
        self._sums: dict[str, NDArray[np.uint64]] = {}  # release -> Σ y over arrivals (U3)
        self._u3: tuple[str, ...] = ()
        self._request: UnmaskRequest | None = None
        self._withheld: dict[str, str] = {}
        self.result: SecAggResult | None = None

    # -- receiving -----------------------------------------------------------------------------
    def receive(self, message: ClientMessage, *, sender: str) -> None:
        """Accept one client message; ``sender`` is the transport-authenticated site id."""
        if self.stage in (Stage.DONE, Stage.ABORTED):
            raise StageError(f"the round is {self.stage.value}; no message is accepted")
        if message.round_id != self.config.round_id:
            raise RoundMismatchError(
                f"message for round {message.round_id!r}, this server runs {self.config.round_id!r}"
            )
        stage = _MESSAGE_STAGE.get(type(message))
        if stage is None:
            raise ProtocolError(f"not a client message: {type(message).__name__}")
        if stage is not self.stage:
            raise StageError(
                f"{type(message).__name__} from {sender!r} belongs to stage {stage.value}, "
                f"the server is in stage {self.stage.value}"
            )
        if message.site_id != sender:
            raise ProtocolError(f"message from {sender!r} claims to be from {message.site_id!r}")
        if sender not in self.config.cohort:
            raise UnknownParticipantError(f"{sender!r} is not in the round's cohort")
        if sender not in self._live:
            raise UnknownParticipantError(
                f"{sender!r} dropped out before stage {self.stage.value} and cannot rejoin"
            )
        if sender in self._inbox:
            raise DuplicateMessageError(f"a second {type(message).__name__} from {sender!r}")
        self._validate(message)
        if isinstance(message, MaskedInputUpload):  # kept as running sums, not per site
            for name, y in message.vectors:
                total = self._sums.setdefault(name, np.zeros(y.shape, dtype=np.uint64))
                np.add(total, y, out=total)
            message = MaskedInputUpload(message.round_id, message.site_id, ())
        self._inbox[sender] = message

    def _validate(self, message: ClientMessage) -> None:
        if isinstance(message, AdvertiseKeys):
            self._validate_graph_reveal(message)
            fields = signed_advert_fields(self.config, message)
            self._verify(message.site_id, message.signature, ADVERTISE_CONTEXT, fields)
        elif isinstance(message, ShareKeysUpload):
            recipients = [s.recipient for s in message.shares]
            expected = set(self._live) - {message.site_id}
            if self.neighbours is not None:
                expected &= self.neighbours[message.site_id]
            if len(set(recipients)) != len(recipients) or set(recipients) != expected:
                raise ProtocolError(
                    f"{message.site_id!r} must send one share bundle to each of U1 "
                    "(its neighbours, with a sparse graph)"
                )
            if any(s.sender != message.site_id for s in message.shares):
                raise ProtocolError(f"{message.site_id!r} sent share bundles of another sender")
        elif isinstance(message, MaskedInputUpload):
            self._validate_upload(message)
        elif isinstance(message, ConsistencySignature):
            fields = consistency_fields(self.config, site_id=message.site_id, survivors=self._u3)
            self._verify(message.site_id, message.signature, CONSISTENCY_CONTEXT, fields)
        else:
            assert self._request is not None
            got = [(s.kind, s.owner, s.release) for s in message.shares]
            wanted = expected_reveals(
                self.config,
                survivors=self._request.survivors,
                dropped=self._request.dropped,
                releases=self._request.releases,
                responder=message.site_id,
                neighbours=self.neighbours,
            )
            if len(set(got)) != len(got) or set(got) != wanted:
                raise ProtocolError(f"{message.site_id!r} did not reveal exactly the asked shares")

    def _validate_graph_reveal(self, advert: AdvertiseKeys) -> None:
        if self.config.graph is None:
            if advert.commitments_digest or advert.graph_nonce:
                raise ProtocolError(f"{advert.site_id!r} sent a graph nonce for the full graph")
            return
        if advert.commitments_digest != self._digest:
            raise ProtocolError(f"the advert of {advert.site_id!r} binds other graph commitments")
        try:
            opened = graph_commitment(
                round_id=self.config.round_id, site_id=advert.site_id, nonce=advert.graph_nonce
            )
        except ProtocolError as exc:
            raise ProtocolError(f"the advert of {advert.site_id!r}: {exc}") from exc
        if opened != self._commitments[advert.site_id]:
            raise ProtocolError(
                f"the graph nonce of {advert.site_id!r} does not open its commitment"
            )

    def _verify(self, site: str, signature: bytes, context: str, fields: tuple[Field, ...]) -> None:
        try:
            verify_fields(self._identities[site], signature, context=context, fields=fields)
        except CryptoError as exc:
            raise ProtocolError(f"{context} signature of {site!r} does not verify") from exc

    def _validate_upload(self, message: MaskedInputUpload) -> None:
        expected = {r.name: r.length for r in self.config.releases_of(message.site_id)}
        names = [name for name, _ in message.vectors]
        if len(set(names)) != len(names) or set(names) != set(expected):
            raise ProtocolError(
                f"{message.site_id!r} must upload exactly its releases {sorted(expected)}"
            )
        for name, y in message.vectors:
            if (
                not isinstance(y, np.ndarray)
                or y.dtype != np.uint64
                or y.shape != (expected[name],)
            ):
                raise ProtocolError(
                    f"{message.site_id!r}: release {name!r} needs a uint64 vector of length "
                    f"{expected[name]}"
                )

    # -- closing stages ------------------------------------------------------------------------
    def _close(self, stage: Stage, following: Stage) -> tuple[str, ...]:
        if self.stage is not stage:
            raise StageError(f"cannot close stage {stage.value} in stage {self.stage.value}")
        arrived = tuple(sorted(self._inbox))
        if len(arrived) < self.config.t:
            reason = (
                f"{stage.value}: only {len(arrived)} of {len(self.config.cohort)} clients "
                f"responded, fewer than the threshold t={self.config.t}; round aborted, "
                "nothing released"
            )
            self._abort(reason)
        self.stage = following
        self._live = arrived
        return arrived

    def _abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.stage = Stage.ABORTED
        self._sums.clear()
        raise RoundAbortedError(reason)

    def close_advertise(self) -> KeyDirectory:
        """End AdvertiseKeys: U1 = the sites whose signed adverts arrived (sparse graph: every
        participant, else the round aborts; then the graph is derived)."""
        silent = sorted(set(self.config.cohort) - set(self._inbox))
        if self.config.graph is not None and silent and self.stage is Stage.ADVERTISE:
            self._abort(
                f"advertise-keys: no advert (graph nonce) from {', '.join(silent)}; the sparse "
                "graph is drawn from every participant's nonce; round aborted, nothing released"
            )
        u1 = self._close(Stage.ADVERTISE, Stage.SHARE_KEYS)
        self._adverts = {s: m for s, m in self._inbox.items() if isinstance(m, AdvertiseKeys)}
        self._inbox = {}
        if self.config.graph is not None:
            seed = graph_seed(
                config_digest=self.config.digest(),
                digest=self._digest,
                nonces={s: a.graph_nonce for s, a in self._adverts.items()},
            )
            self.neighbours = derive_graph(
                self.config.cohort, degree=self.config.graph.degree, seed=seed
            )
        return KeyDirectory(self.config.round_id, tuple(self._adverts[s] for s in u1))

    def close_share_keys(self) -> dict[str, RoutedShares]:
        """End ShareKeys: U2 = senders; route each bundle from U2 to its recipient in U2."""
        u2 = self._close(Stage.SHARE_KEYS, Stage.MASKED_INPUT)
        self._u2 = u2
        routed: dict[str, list[EncryptedShare]] = {v: [] for v in u2}
        for sender in u2:
            upload = self._inbox[sender]
            assert isinstance(upload, ShareKeysUpload)
            for item in upload.shares:
                if item.recipient in routed:
                    routed[item.recipient].append(item)
        self._inbox = {}
        return {
            v: RoutedShares(self.config.round_id, v, tuple(items)) for v, items in routed.items()
        }

    def close_masked_input(self) -> ConsistencyRequest:
        """End MaskedInput: U3 = sites whose masked uploads arrived (only these are stored)."""
        u3 = self._close(Stage.MASKED_INPUT, Stage.CONSISTENCY)
        self._u3 = u3
        self._inbox = {}
        return ConsistencyRequest(self.config.round_id, u3)

    def close_consistency(self) -> UnmaskRequest:
        """End ConsistencyCheck: U4 = signers; decide which releases are released."""
        self._close(Stage.CONSISTENCY, Stage.UNMASK)
        signatures = tuple(
            m for _, m in sorted(self._inbox.items()) if isinstance(m, ConsistencySignature)
        )
        self._inbox = {}
        released = []
        for release in self.config.releases:
            alive = len(set(release.members) & set(self._u3))
            if alive >= release.min_survivors:
                released.append(release.name)
            else:
                self._withheld[release.name] = (
                    f"{alive} of {len(release.members)} members survived, fewer than the "
                    f"release minimum {release.min_survivors}"
                )
                self._sums.pop(release.name, None)
        dropped = tuple(s for s in self._u2 if s not in self._u3)
        self._request = UnmaskRequest(
            self.config.round_id, self._u3, dropped, tuple(released), signatures
        )
        return self._request

    def close_unmask(self) -> SecAggResult:
        """End Unmask: reconstruct dropped mask keys and survivors' self masks; decode sums."""
        u5 = self._close(Stage.UNMASK, Stage.DONE)
        assert self._request is not None
        responses = {s: m for s, m in self._inbox.items() if isinstance(m, UnmaskResponse)}
        self._inbox = {}
        publics = {s: a.mask_public for s, a in self._adverts.items()}
        try:
            shares = collect_shares(self.config, {s: responses[s] for s in u5})
            keys = reconstruct_mask_keys(
                self.config, shares, dropped=self._request.dropped, mask_publics=publics
            )
            sums: dict[str, NDArray[np.float64]] = {}
            contributors: dict[str, tuple[str, ...]] = {}
            for name in self._request.releases:
                release = self.config.release(name)
                seeds = reconstruct_self_seeds(
                    self.config, shares, survivors=self._u3, release=release
                )
                survivors = tuple(s for s in self._u3 if s in release.members)
                total = self._sums.get(name)
                sums[name] = release_sum(
                    self.config,
                    release=release,
                    masked_total=ring_sum([] if total is None else [total], length=release.length),
                    survivors=survivors,
                    live=self._u2,
                    self_seeds=seeds,
                    mask_keys=keys,
                    mask_publics=publics,
                    neighbours=self.neighbours,
                )
                contributors[name] = survivors
        except (ProtocolError, MaskingError) as exc:
            self.stage = Stage.ABORTED
            self.abort_reason = f"unmask failed: {exc}"
            raise RoundAbortedError(self.abort_reason) from exc
        finally:
            self._sums.clear()
        self.result = SecAggResult(
            sums, contributors, dict(self._withheld), self._u3, self._request.dropped
        )
        return self.result

    @property
    def held_sums(self) -> Mapping[str, NDArray[np.uint64]]:
        """The masked vectors the server holds: one running sum per release (a copy)."""
        return {name: total.copy() for name, total in self._sums.items()}
