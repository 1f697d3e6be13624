"""The daemon's conversation with the coordinator: every RPC with retries and back-off
(:func:`afl.client.daemon_transport.with_retry`), enrolment, chunked uploads and downloads, and
waiting for a round and for a round's stage. Used by the site daemon, its aggregation modes and the
CKKS decryptor alike.

Enrolment (``Enroll``): the identity public key with a proof of possession (signature, context
"enrol", over (federation_id, site_id, identity_public_key)), and what the site declares about its
features (backbone, d, weights digest, random-init stamp, row bounds when its policy allows); the
reply must name this federation and this site and carry the server identity key of the startup
kit; a note in the reply (e.g. classes the federation does not use) is logged.

Polling interval: starts at ``poll_interval_s`` and grows by 1.5x per idle poll up to
``max_poll_interval_s``; waits give up after ``max_wait_s`` (DaemonError), or, when
``lingering``, return None after ``linger_s`` without a new round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.client.config import TimingConfig
from afl.client.daemon_transport import (
    DaemonError,
    RetryPolicy,
    download_payload,
    upload_payload,
    with_retry,
)
from afl.core.row_bounds import RowBounds
from afl.crypto import signatures, signed_blobs
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["CoordinatorClient", "RoundFailed"]

log = logging.getLogger("afl.client")


STAGE_POLL_CAP_S = 0.25


class RoundFailed(DaemonError):
    """A round ended for this site without a model (refused, aborted or failed)."""

    def __init__(self, outcome: int, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


class CoordinatorClient:
    """RPCs of one site with its deadline, retry policy and (insecure mode) metadata."""

    def __init__(
        self,
        stub: Any,
        *,
        site_id: str,
        timing: TimingConfig,
        retry: RetryPolicy,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.stub = stub
        self.site_id = site_id
        self.timing = timing
        self.retry = retry
        self.metadata = metadata

    def call(self, what: str, request: Any, **kw: Any) -> Any:
        """``stub.<what>(request)`` with the RPC deadline and retries."""
        method = getattr(self.stub, what)
        timeout = self.timing.rpc_timeout_s
        return with_retry(
            lambda: method(request, timeout=timeout, metadata=self.metadata or None, **kw),
            what=what,
            policy=self.retry,
        )

    def upload(
        self,
        data: bytes,
        *,
        round_id: str,
        release_name: str,
        kind: int = pb.PAYLOAD_KIND_STATISTIC,
    ) -> pb.UploadReceipt:
        """A chunked ``Upload`` whose receipt is checked against what was sent."""
        return upload_payload(
            self.stub,
            data,
            round_id=round_id,
            release_name=release_name,
            kind=kind,
            policy=self.retry,
            timeout_s=self.timing.upload_timeout_s,
            metadata=self.metadata,
        )

    def download(self, request: pb.DownloadRequest) -> bytes:
        """A ``Download`` stream, reassembled and digest-checked."""
        return download_payload(
            self.stub,
            request,
            policy=self.retry,
            timeout_s=self.timing.upload_timeout_s,
            metadata=self.metadata,
        )

    def enroll(
        self,
        *,
        federation_id: str,
        identity: Ed25519PrivateKey,
        identity_public_key: bytes,
        server_public_key: bytes,
        role: int,
        labelled_classes: Sequence[str] = (),
        backbone: str = "",
        feature_dim: int = 0,
        software_version: str = "",
        row_bounds: RowBounds | None = None,
        weights_sha256: str = "",
        random_init: bool = False,
    ) -> pb.EnrollResponse:
        """Enroll this site (module docstring); :class:`DaemonError` if the reply does not match
        the startup kit."""
        proof = signatures.sign_fields(
            identity,
            context=signed_blobs.ENROL_CONTEXT,
            fields=signed_blobs.enrol_fields(
                federation_id=federation_id,
                site_id=self.site_id,
                identity_public_key=identity_public_key,
            ),
        )
        request = pb.EnrollRequest(
            identity_public_key=identity_public_key,
            proof=proof,
            role=role,  # type: ignore[arg-type]
            labelled_classes=list(labelled_classes),
            backbone=backbone,
            feature_dim=feature_dim,
            software_version=software_version,
            protocol_version=wire.PROTOCOL_VERSION,
            declared_rows=row_bounds.rows if row_bounds else 0,
            declared_max_row_norm=row_bounds.max_row_norm if row_bounds else 0.0,
            weights_sha256=weights_sha256,
            random_init=random_init,
        )
        response: pb.EnrollResponse = self.call("Enroll", request, wait_for_ready=True)
        if response.server_identity_public_key != server_public_key:
            raise DaemonError("the server's identity key differs from the one in the startup kit")
        if response.federation_id != federation_id:
            raise DaemonError(f"the server serves federation {response.federation_id!r}")
        if response.site_id and response.site_id != self.site_id:
            raise DaemonError(f"the server sees this site as {response.site_id!r}")
        if response.message and response.message != "enrolled":
            log.warning("site=%s enrolment: %s", self.site_id, response.message)
        return response

    def status(self, round_id: str = "") -> pb.StatusResponse:
        status: pb.StatusResponse = self.call("GetStatus", pb.StatusRequest(round_id=round_id))
        return status

    def _sleep_backoff(self, delay: float, *, cap: float | None = None) -> float:
        time.sleep(delay)
        return min(delay * 1.5, self.timing.max_poll_interval_s if cap is None else cap)

    def wait_for_round(self, done: set[str], *, lingering: bool) -> pb.RoundStatus | None:
        """The next round this site takes part in, or None after ``linger_s`` without one."""
        t = self.timing
        start = time.monotonic()
        delay = t.poll_interval_s
        while True:
            status = self.status()
            r = status.round if status.HasField("round") else None
            if r is not None and r.round_id not in done:
                waiting = r.stage in (
                    pb.ROUND_STAGE_UNSPECIFIED,
                    pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS,
                )
                missed = r.stage >= pb.ROUND_STAGE_SOLVING and not r.caller_accepted_plan
                if not waiting and (self.site_id not in r.participants or missed):
                    log.info("site=%s takes no part in round %s", self.site_id, r.round_id)
                    done.add(r.round_id)
                elif not waiting and r.stage != pb.ROUND_STAGE_ABORTED:
                    return r
            elapsed = time.monotonic() - start
            if lingering and elapsed > t.linger_s:
                return None
            if elapsed > t.max_wait_s:
                raise DaemonError(f"no round opened within max_wait_s = {t.max_wait_s:g} s")
            delay = self._sleep_backoff(delay)

    def await_stage(self, round_id: str, *, at_least: int) -> pb.RoundStatus:
        """Poll until the round reaches ``at_least``; :class:`RoundFailed` if it aborts."""
        t = self.timing
        start = time.monotonic()
        delay = t.poll_interval_s
        while True:
            r = self.status(round_id).round
            if r.stage == pb.ROUND_STAGE_ABORTED:
                raise RoundFailed(pb.CLIENT_OUTCOME_ABORTED, f"round aborted: {r.abort_reason}")
            if r.stage >= at_least:
                return r
            if time.monotonic() - start > t.max_wait_s:
                raise DaemonError(f"round {round_id} did not reach stage {at_least} in time")
            # Within a round the next stage is usually seconds away (the peers' work), so the
            # poll interval stays short instead of backing off to max_poll_interval_s.
            delay = self._sleep_backoff(delay, cap=min(STAGE_POLL_CAP_S, t.max_poll_interval_s))
