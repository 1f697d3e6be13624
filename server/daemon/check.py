"""`afl-server check --config server.toml`: everything a coordinator needs before it starts,
each as one line (docs/operations.md): the config, the TLS kit (chain to the federation CA,
expiry, key match), the identity key, the state folder, the gRPC and metrics ports, the round
settings and the aggregation mode. Exit status 0 when nothing is a PROBLEM, else 1.
"""

from __future__ import annotations

import os
from pathlib import Path

from afl.crypto.errors import KeyFormatError
from afl.crypto.identity.kit_check import OK, PROBLEM, WARNING, Finding, check_tls_kit
from afl.crypto.identity.pki import PkiError, load_certificate_pem
from afl.crypto.identity.revocation import load_crl, revoked_serials
from afl.crypto.identity.signatures import load_private_key_pem, public_key_to_raw
from afl.proto.wire import stage_name
from afl.server.config import ServerConfig
from afl.server.daemon.ports import port_in_use
from afl.server.errors import ConfigError, StateError
from afl.server.modes.base import ModeEnvironment
from afl.server.modes.ckks_context import CkksContexts
from afl.server.modes.registry import mode_for
from afl.server.store import Store

__all__ = ["check_server"]


def _identity(config: ServerConfig) -> Finding:
    try:
        key = load_private_key_pem(config.identity_key.read_bytes())
    except (OSError, KeyFormatError) as exc:
        return Finding(PROBLEM, f"cannot load the identity key {config.identity_key}: {exc}")
    if public_key_to_raw(key) != config.identity_public_key:
        return Finding(
            PROBLEM, f"[identity] public_key does not match the key file {config.identity_key}"
        )
    return Finding(OK, f"identity key {config.identity_key} matches [identity] public_key")


def _state(config: ServerConfig) -> Finding:
    folder = config.state_dir
    if not (folder / "server.sqlite3").is_file():
        parent = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK):
            return Finding(
                PROBLEM, f"state_dir {folder}: cannot be created ({parent} is read-only)"
            )
        return Finding(OK, f"state_dir {folder}: no state yet (a new federation state is created)")
    if not os.access(folder, os.W_OK):
        return Finding(PROBLEM, f"state_dir {folder} is not writable by this user")
    try:
        store = Store(folder, federation_id=config.federation_id, read_only=True)
    except StateError as exc:
        return Finding(PROBLEM, str(exc))
    try:
        rounds = store.rounds()
    finally:
        store.close()
    if not rounds:
        return Finding(OK, f"state_dir {folder}: federation {config.federation_id}, no round yet")
    last = rounds[-1]
    return Finding(
        OK,
        f"state_dir {folder}: {len(rounds)} round(s); the server resumes round {last.round_id} "
        f"({stage_name(last.stage).removeprefix('ROUND_STAGE_')})",
    )


def _port(what: str, address: str) -> Finding:
    busy = port_in_use(address)
    if busy:
        return Finding(PROBLEM, f"{what} {address}: {busy}")
    return Finding(OK, f"{what} {address} is free")


def _round(config: ServerConfig) -> list[Finding]:
    r = config.round
    out = [
        Finding(
            OK,
            f"round: {len(r.classes)} classes {list(r.classes)}, d = {r.feature_dim}, "
            f"gram_scope {r.gram_scope}, {r.rounds} round(s), participants "
            f"{', '.join(r.participants)} (min_participants {r.min_participants})",
        )
    ]
    if not r.backbone:
        out.append(
            Finding(WARNING, "[round] backbone is empty: sites' feature extractors are not checked")
        )
    elif r.backbone_sha256:
        out.append(
            Finding(OK, f"backbone {r.backbone}, weights pinned to sha256 {r.backbone_sha256}")
        )
    else:
        out.append(
            Finding(
                WARNING,
                f'backbone {r.backbone}, weights NOT pinned ([round] backbone_sha256 = ""): '
                "sites with other weights of the same architecture would be accepted",
            )
        )
    if r.allow_random_init:
        out.append(
            Finding(WARNING, "allow_random_init = true: a TEST federation (random features)")
        )
    try:
        mode = mode_for(ModeEnvironment(config, r, CkksContexts.from_config(config)))
    except (ValueError, ConfigError, OSError) as exc:
        return [*out, Finding(PROBLEM, f"aggregation {r.aggregation}: {exc}")]
    detail = f"aggregation {mode.name}"
    if r.mask is not None:
        detail += f"; mask bounds from {r.mask.source}"
    if r.dp is not None:
        detail += f"; DP epsilon {r.dp.epsilon:g}"
    if r.evaluate:
        detail += f"; then a federated evaluation (calibration {r.eval_calibration})"
    out.append(Finding(OK, detail))
    return out


def _revocation(config: ServerConfig) -> Finding:
    """The CA's revocation list ([tls] crl, M-173): signed by the federation CA, or a PROBLEM
    (the coordinator would refuse every certificate)."""
    if config.crl is None:
        return Finding(WARNING, "no [tls] crl: no certificate can be revoked (`afl ca revoke`)")
    try:
        ca = load_certificate_pem(config.ca_cert.read_bytes())
        crl = load_crl(config.crl.read_bytes(), ca_certificate=ca)
    except (OSError, PkiError) as exc:
        return Finding(PROBLEM, f"revocation list {config.crl}: {exc}; every call would be refused")
    return Finding(OK, f"revocation list {config.crl}: {len(revoked_serials(crl))} revoked")


def check_server(config: ServerConfig, *, insecure: bool = False) -> list[Finding]:
    """Every finding for ``config`` (module docstring); the config itself already loaded."""
    out = [
        Finding(
            OK,
            f"config {config.path}: federation {config.federation_id}, {len(config.sites)} "
            "provisioned site(s)",
        )
    ]
    if not insecure:
        out += check_tls_kit(ca_cert=config.ca_cert, cert=config.cert, key=config.key)
        out.append(_revocation(config))
    out.append(_identity(config))
    out.append(_state(config))
    out.append(_port("gRPC listen address", config.listen))
    if config.metrics_port:
        out.append(_port("metrics", f"{config.metrics_address}:{config.metrics_port}"))
    out += _round(config)
    return out
