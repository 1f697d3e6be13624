"""`afl-client doctor --config client.toml` and `afl-client status --config client.toml`
(docs/operations.md): what a hospital's IT needs to know before and while the daemon runs, one
line per item, no source code to read.

doctor checks, in order:

* the kit: the TLS certificate chains to the federation CA, is within its validity period and
  names this site, the TLS key belongs to it (:mod:`afl.crypto.identity.kit_check`); the identity key
  matches ``[identity] public_key`` (the config loader refuses a mismatch);
* the coordinator: the address resolves, a TCP connection opens, mutual TLS succeeds
  (:func:`afl.client.connectivity.probe` names the cause otherwise), and ``GetStatus`` answers
  for this site (federation id, enrolment, the current round, and why the current run leaves
  the site out when it does: a WARNING);
* the feature cache: images, d, backbone, weights digest, RANDOM-INIT/SURROGATE stamps, and per
  labelled class its positives and negatives (a class without both is skipped at this site);
* the values masked rounds use: N and the largest feature-row norm L, measured and as declared
  (powers of two, :mod:`afl.core.row_bounds`), with the Gram and class-vector bounds they give;
* the state folder is writable;
* the effective ``[policy]`` (one line) and, as a WARNING, every value less protective than the
  production defaults (:mod:`afl.client.policy.defaults`).

Exit status 0 when nothing is a PROBLEM, else 1 (2 when client.toml itself cannot be loaded).
status prints the local state (last report, last model) and the coordinator's view (with the
reason the current run leaves the site out, if it does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from afl.client.config import ClientConfig
from afl.client.connectivity import probe
from afl.client.daemon.transport import INSECURE_SITE_HEADER, open_channel
from afl.client.payloads.stats import PayloadError, labelled_mask
from afl.client.policy.defaults import permissive_settings, policy_summary
from afl.core.data.featurecache import FeatureCache, FeatureCacheError, open_cache
from afl.core.row_bounds import measure
from afl.crypto.identity import pki
from afl.crypto.identity.kit_check import OK, PROBLEM, WARNING, Finding, check_tls_kit
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["ask_server", "doctor", "status_lines"]


def _stage(stage: int) -> str:
    return pb.RoundStage.Name(stage).removeprefix("ROUND_STAGE_")  # type: ignore[arg-type]


def ask_server(
    config: ClientConfig, *, insecure: bool = False
) -> tuple[pb.StatusResponse | None, str]:
    """The coordinator's ``GetStatus`` for this site, or None and one line saying why not."""
    reach = probe(config, insecure=insecure)
    if not reach.ok:
        return None, reach.message
    metadata = ((INSECURE_SITE_HEADER, config.site_id),) if insecure else None
    with open_channel(config, insecure=insecure) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        try:
            status: pb.StatusResponse = stub.GetStatus(
                pb.StatusRequest(),
                timeout=min(15.0, config.timing.rpc_timeout_s),
                metadata=metadata,
            )
        except grpc.RpcError as exc:
            code = exc.code().name if callable(getattr(exc, "code", None)) else "?"
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            return None, f"{config.server_address}: GetStatus refused: {code}: {details}"
    return status, reach.message


def _kit(config: ClientConfig) -> list[Finding]:
    out = check_tls_kit(ca_cert=config.tls.ca_cert, cert=config.tls.cert, key=config.tls.key)
    try:
        named = pki.site_id_from_pem(config.tls.cert.read_bytes())
    except (OSError, pki.PkiError) as exc:
        return [*out, Finding(PROBLEM, f"{config.tls.cert} names no site: {exc}")]
    if named != config.site_id:
        out.append(
            Finding(
                PROBLEM,
                f"{config.tls.cert} is site {named!r}'s certificate, but [client] site_id is "
                f"{config.site_id!r}",
            )
        )
    out.append(
        Finding(OK, f"identity key {config.identity_key_path} matches [identity] public_key")
    )
    return out


def _server(config: ClientConfig, *, insecure: bool) -> list[Finding]:
    status, message = ask_server(config, insecure=insecure)
    if status is None:
        return [Finding(PROBLEM, f"coordinator: {message}")]
    out = [Finding(OK, f"coordinator: {message}")]
    if status.federation_id != config.federation_id:
        out.append(
            Finding(
                PROBLEM,
                f"the server serves federation {status.federation_id!r}, this kit is for "
                f"{config.federation_id!r}",
            )
        )
        return out
    line = f"federation {status.federation_id}: this site is {'' if status.enrolled else 'NOT yet '}enrolled"
    if status.HasField("round"):
        r = status.round
        line += f"; round {r.round_id} is {_stage(r.stage)}"
    out.append(Finding(OK, line))
    if status.note:  # the current run leaves this site out (another backbone, weights, ...)
        out.append(Finding(WARNING, f"left out of the current run: {status.note}"))
    return out


def _cache(config: ClientConfig) -> tuple[list[Finding], FeatureCache | None]:
    try:
        cache = open_cache(config.data.cache)
    except FeatureCacheError as exc:
        first = (  # a damaged cache's message names its own fix
            ""
            if (Path(config.data.cache) / "meta.json").exists()
            else f" (run `afl-client extract --out {config.data.cache} ...` first)"
        )
        return [Finding(PROBLEM, f"[data] cache {config.data.cache}: {exc}{first}")], None
    meta = cache.meta
    digest = meta.extra.get("weights_sha256") or "none"
    out = [
        Finding(
            OK,
            f"feature cache {cache.root}: {meta.n} images x d = {meta.d}; backbone "
            f"{meta.extra.get('backbone', meta.source)}; weights sha256 {digest}",
        )
    ]
    if meta.n == 0:
        out.append(Finding(PROBLEM, "the cache holds no images"))
    if meta.random_init:
        out.append(
            Finding(
                WARNING,
                "RANDOM-INIT features (test only): a federation refuses them unless its "
                "[round] allow_random_init = true",
            )
        )
    if meta.surrogate:
        out.append(Finding(WARNING, "SURROGATE features (simulation data, not images)"))
    unreadable = int(meta.extra.get("n_unreadable", 0))
    if unreadable:
        out.append(
            Finding(
                WARNING,
                f"{unreadable} images were unreadable (listed in {cache.root}/unreadable.csv)",
            )
        )
    try:
        mask, names = labelled_mask(cache, config.data.classes)
    except PayloadError as exc:
        return [*out, Finding(PROBLEM, str(exc))], cache
    if not names:
        out.append(Finding(WARNING, "this site labels no class: it contributes its Gram only"))
    for i in np.flatnonzero(mask):
        column = cache.labels[:, i]
        pos, neg = int((column == 1).sum()), int((column == 0).sum())
        level = OK if pos and neg else WARNING
        note = "" if pos and neg else " (skipped at this site: needs positives and negatives)"
        out.append(Finding(level, f"class {meta.classes[i]}: {pos} positive, {neg} negative{note}"))
    partial = [
        c for i, c in enumerate(meta.classes) if not mask[i] and (cache.labels[:, i] >= 0).any()
    ]
    if partial and not config.data.classes:
        out.append(
            Finding(
                WARNING,
                f"classes {partial} are labelled in some rows only (-1 elsewhere), so this site "
                "does not use them; -1 means 'not labelled' (re-extract with --uncertain-as if "
                "your -1 means 'uncertain')",
            )
        )
    return out, cache


def _bounds(config: ClientConfig, cache: FeatureCache) -> Finding:
    measured = measure(cache.features)
    declared = measured.declared()
    text = (
        f"masked rounds: N = {measured.rows} rows, largest feature-row norm L = "
        f"{measured.max_row_norm:.6g}"
    )
    if config.policy.disclose_row_bounds:
        return Finding(
            OK,
            f"{text}; declared at enrolment as N <= {declared.rows}, L <= "
            f"{declared.max_row_norm:g} (Gram bound {declared.gram_bound:g}, class-vector bound "
            f"{declared.vector_bound:g}); nothing to set by hand",
        )
    return Finding(
        WARNING,
        f"{text}; NOT declared ([policy] disclose_row_bounds = false): the coordinator must set "
        f"mask_max_samples >= {declared.rows} and mask_feature_norm >= {declared.max_row_norm:g}",
    )


def _policy(config: ClientConfig) -> list[Finding]:
    """The effective [policy] in one line, and one WARNING naming every permissive value."""
    out = [Finding(OK, policy_summary(config.policy))]
    loose = permissive_settings(config.policy)
    if loose:
        kit = " (a development kit)" if config.policy.profile == "development" else ""
        out.append(Finding(WARNING, f"permissive [policy]{kit}: {'; '.join(loose)}"))
    return out


def _state(config: ClientConfig) -> Finding:
    folder = config.state_dir
    parent = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    if not os.access(parent, os.W_OK):
        return Finding(PROBLEM, f"state_dir {folder} is not writable by this user")
    return Finding(OK, f"state_dir {folder} is writable")


def doctor(config: ClientConfig, *, insecure: bool = False, connect: bool = True) -> list[Finding]:
    """Every finding for ``config`` (module docstring)."""
    out = [Finding(WARNING, w) for w in config.warnings]
    out.append(
        Finding(OK, f"config {config.path}: site {config.site_id}, server {config.server_address}")
    )
    out += _policy(config)
    if not insecure:
        out += _kit(config)
    if connect:
        out += _server(config, insecure=insecure)
    if config.role == "participant":
        found, cache = _cache(config)
        out += found
        if cache is not None and cache.meta.n:
            out.append(_bounds(config, cache))
    out.append(_state(config))
    return out


def _last_report(config: ClientConfig) -> dict[str, Any] | None:
    reports = sorted((config.state_dir / "reports").glob("*.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(reports):
        try:
            report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            return report
        except (OSError, ValueError):
            continue
    return None


def status_lines(config: ClientConfig, *, insecure: bool = False) -> list[str]:
    """This site's state on one screen: enrolment and the current round (from the coordinator),
    the last round's outcome and error, the last verified model (from ``state_dir``)."""
    lines = [
        f"site {config.site_id}  federation {config.federation_id}  (state {config.state_dir})"
    ]
    status, message = ask_server(config, insecure=insecure)
    if status is None:
        lines.append(f"coordinator: UNREACHABLE: {message}")
    else:
        lines.append(
            f"coordinator {config.server_address}: {'enrolled' if status.enrolled else 'NOT enrolled'}"
        )
        if status.HasField("round"):
            r = status.round
            lines.append(
                f"current round {r.round_id} (number {r.round_number}): {_stage(r.stage)}"
                + (f"; abort reason: {r.abort_reason}" if r.abort_reason else "")
            )
        else:
            lines.append("current round: none for this site")
        if status.note:
            lines.append(f"left out of the current run: {status.note}")
        if status.latest_model_round_id:
            lines.append(f"latest published model: round {status.latest_model_round_id}")
    report = _last_report(config)
    if report is None:
        lines.append("last round: none taken part in yet")
    else:
        outcome = report.get("outcome", "?")
        lines.append(f"last round {report.get('round_id') or '-'}: {outcome}")
        if report.get("reason"):
            lines.append(f"last error: {report['reason']}")
    models = sorted(
        (config.state_dir / "models").glob("*.signed-model.pb"), key=lambda p: p.stat().st_mtime
    )
    lines.append(  # the signed file is what `afl export --model` and `evaluate --model` take
        f"last model: {models[-1]} (signed; `afl export --model` takes this file)"
        if models
        else "last model: none received yet"
    )
    return lines
