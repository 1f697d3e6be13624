"""MASK aggregation mode of the afl-client (Bonawitz et al. CCS'17; design §6; issue 5).

The site runs :class:`afl.crypto.secagg_client.SecAggClient` over the coordinator's MASK RPCs:

    AdvertiseKeys -> (ShareKeys stage) GetAdvertisedKeys, ShareKeys -> (UPLOAD) GetSharedKeys,
    Upload of y_{u,R} per release -> (CONSISTENCY_CHECK) GetSurvivors, ConsistencyCheck ->
    (UNMASK) GetUnmaskRequest, Unmask

Every server message is checked against the SIGNED plan (the protocol config, including the
config digest bound into every signature, is derived from the plan alone) and the client's own
state by the state machine: peers' adverts and consistency signatures are verified with the
identity keys of the startup kit ([peers]), never keys the server sends; the client refuses an
unmask request that asks for both shares of one peer, names non-survivors, lacks t signatures,
or requests a release below its t_R. Values outside a release's declared bound are an error
(never clipped). Only masked uint64 vectors leave the site.

Fault injection for the drop-out tests: with ``AFL_FAULT_VANISH_AFTER`` set to ``advertise``,
``share-keys``, ``masked-input`` or ``consistency``, the process exits abruptly (``os._exit``, no
report, like a killed site) right after sending that stage's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon_stats import PayloadError, SlotPayload, encode_float64
from afl.client.daemon_transport import MAX_CHUNK_BYTES, DaemonError, upload_payload
from afl.client.mode_mask_wire import (
    advert_to_proto,
    directory_from_proto,
    round_config_from_plan,
    routed_from_proto,
    share_keys_to_proto,
    unmask_request_from_proto,
    unmask_response_to_proto,
)
from afl.crypto.errors import CryptoError
from afl.crypto.secagg_client import SecAggClient
from afl.crypto.secagg_config import default_threshold
from afl.crypto.secagg_messages import ConsistencyRequest
from afl.crypto.signatures import load_public_key_raw
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:  # daemon_modes registers this module: import it lazily (no import cycle)
    from afl.client.daemon_modes import RoundSession, UploadRecord

__all__ = ["FAULT_ENV", "MaskStrategy"]

FAULT_ENV = "AFL_FAULT_VANISH_AFTER"
_FAULT_EXIT = 70


def _vanish_after(stage: str) -> None:
    if os.environ.get(FAULT_ENV) == stage:
        os._exit(_FAULT_EXIT)  # simulated crash: no report, no goodbye


class MaskStrategy:
    """Client side of ``aggregation = "mask"`` (module docstring)."""

    name: str = "mask"
    aggregation: int = int(cpb.AGGREGATION_MODE_MASK)
    first_stage: int = int(pb.ROUND_STAGE_ADVERTISE_KEYS)

    def encode(self, release: cpb.Release, values: NDArray[np.float64]) -> bytes:
        """The site's float64 values, kept locally until masked (checked against the bound)."""
        enc = release.encoding
        if enc.dtype != cpb.DTYPE_UINT64_LE or enc.WhichOneof("scheme") != "fixed_point":
            raise PayloadError(f"release {release.name}: MASK mode needs uint64 fixed point")
        bound = enc.fixed_point.bound
        worst = float(np.max(np.abs(values))) if values.size else 0.0
        if not np.all(np.isfinite(values)) or worst > bound:
            raise PayloadError(
                f"release {release.name}: a value of magnitude {worst:.6g} exceeds the plan's "
                f"declared bound {bound:.6g}; the operator must raise the bound (values are "
                "never clipped)"
            )
        return encode_float64(values)

    def exchange(
        self,
        session: RoundSession,
        payloads: Sequence[SlotPayload],
        *,
        already_complete: Collection[str] = (),
    ) -> list[UploadRecord]:
        if session.plan is None or session.identity_key is None or session.rpc is None:
            raise DaemonError("MASK mode needs the verified plan, identity key and RPC client")
        plan: cpb.ReleasePlan = session.plan
        if already_complete:
            raise DaemonError("a masked round cannot be resumed after its uploads (keys are lost)")
        client = self._client(session, plan, payloads)
        try:
            return self._run(session, client)
        except CryptoError as exc:  # the state machine refused a server message
            raise DaemonError(f"masked exchange refused: {exc}") from exc

    def _run(self, session: RoundSession, client: SecAggClient) -> list[UploadRecord]:
        from afl.client.daemon_modes import UploadRecord

        rpc, rid = session.rpc, session.round_id
        sent: list[UploadRecord] = []

        def record(slot: str, message: Any, start: float) -> None:
            size = message.ByteSize()
            elapsed = time.perf_counter() - start
            sent.append(UploadRecord(slot, (), size, "", 1, False, False, elapsed))

        t0 = time.perf_counter()
        advert = advert_to_proto(client.advertise_keys())
        rpc.call("AdvertiseKeys", advert)
        record("mask/advertise-keys", advert, t0)
        _vanish_after("advertise")

        rpc.await_stage(rid, at_least=pb.ROUND_STAGE_SHARE_KEYS)
        t0 = time.perf_counter()
        keys = rpc.call("GetAdvertisedKeys", cpb.RoundRef(round_id=rid))
        upload = share_keys_to_proto(client.share_keys(directory_from_proto(keys)))
        rpc.call("ShareKeys", upload)
        record("mask/share-keys", upload, t0)
        _vanish_after("share-keys")

        rpc.await_stage(rid, at_least=pb.ROUND_STAGE_UPLOAD)
        t0 = time.perf_counter()
        shared = rpc.call("GetSharedKeys", cpb.RoundRef(round_id=rid))
        masked = client.masked_input(routed_from_proto(shared, recipient=session.site_id))
        for name, y in masked.vectors:
            data = np.ascontiguousarray(y, dtype="<u8").tobytes()
            start = time.perf_counter()
            receipt = upload_payload(
                session.stub,
                data,
                round_id=rid,
                release_name=name,
                policy=session.retry,
                timeout_s=session.upload_timeout_s,
                metadata=session.metadata,
            )
            chunks = max(1, -(-len(data) // MAX_CHUNK_BYTES))
            sent.append(
                UploadRecord(
                    name,
                    (name,),
                    len(data),
                    receipt.sha256.hex(),
                    chunks,
                    bool(receipt.duplicate),
                    False,
                    time.perf_counter() - start,
                )
            )
        _vanish_after("masked-input")

        rpc.await_stage(rid, at_least=pb.ROUND_STAGE_CONSISTENCY_CHECK)
        t0 = time.perf_counter()
        survivors = rpc.call("GetSurvivors", cpb.RoundRef(round_id=rid))
        signed = client.consistency_check(ConsistencyRequest(rid, tuple(survivors.survivors)))
        message = pb.ConsistencySignature(
            round_id=rid, survivors=list(survivors.survivors), signature=signed.signature
        )
        rpc.call("ConsistencyCheck", message)
        record("mask/consistency-check", message, t0)
        _vanish_after("consistency")

        rpc.await_stage(rid, at_least=pb.ROUND_STAGE_UNMASK)
        t0 = time.perf_counter()
        request = rpc.call("GetUnmaskRequest", cpb.RoundRef(round_id=rid))
        response = unmask_response_to_proto(client.unmask(unmask_request_from_proto(request)))
        rpc.call("Unmask", response)
        record("mask/unmask", response, t0)
        return sent

    def _client(
        self, session: RoundSession, plan: cpb.ReleasePlan, payloads: Sequence[SlotPayload]
    ) -> SecAggClient:
        try:
            config = round_config_from_plan(plan)
        except CryptoError as exc:
            raise DaemonError(f"the MASK plan is not valid: {exc}") from exc
        if config.t < default_threshold(len(config.cohort)):
            raise DaemonError(
                f"the plan's threshold t={config.t} is below a majority of the "
                f"{len(config.cohort)} participants"
            )
        identities = _peer_identities(session.peer_keys, config.cohort)
        inputs = {
            name: np.frombuffer(item.payload, dtype="<f8").astype(np.float64)
            for item in payloads
            for name in item.releases
        }
        try:
            return SecAggClient(
                site_id=session.site_id,
                identity_key=session.identity_key,
                config=config,
                identities=identities,
                inputs=inputs,
            )
        except CryptoError as exc:
            raise DaemonError(f"cannot mask this site's statistics: {exc}") from exc


def _peer_identities(peers: Mapping[str, bytes], cohort: Sequence[str]) -> dict[str, Any]:
    """Identity keys of the cohort from the startup kit; a site the kit does not know is refused."""
    unknown = sorted(set(cohort) - set(peers))
    if unknown:
        raise DaemonError(
            f"the startup kit has no identity key for {unknown}; cannot verify their signatures"
        )
    return {s: load_public_key_raw(peers[s]) for s in cohort}
