"""``client.toml``: the afl-client daemon's configuration, written by ``afl provision`` or
``afl-client init --import`` (:mod:`afl.ops.provisioning`) and completed by the site's IT.

Every table and key, with its default and meaning, is in ``deploy/client.example.toml`` (loaded
by this module in ``tests/test_deploy_files.py``); what a hospital sets and why is in
docs/operations.md §3, the protocol rules each ``[policy]`` key enforces in docs/protocol.md §2
and §6-§7. Unknown keys are warnings, except in ``[policy]``, where an unknown key is an error
naming the nearest known one (a misspelt protection setting would otherwise leave the site at the
default it meant to change), and policy keys are checked for type and range.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afl.core.suggest import did_you_mean
from afl.crypto.errors import KeyFormatError
from afl.crypto.identity import signatures

__all__ = [
    "AGGREGATION_NAMES",
    "PROTECTED_AGGREGATION",
    "ClientConfig",
    "ConfigError",
    "DataConfig",
    "LocalPolicy",
    "RetentionConfig",
    "TimingConfig",
    "TlsPaths",
    "load_client_config",
]

_KNOWN: dict[str, set[str]] = {
    "client": {
        "site_id",
        "federation_id",
        "server",
        "role",
        "state_dir",
        "poll_interval_s",
        "max_poll_interval_s",
        "rpc_timeout_s",
        "upload_timeout_s",
        "max_wait_s",
        "linger_s",
        "retry_attempts",
        "retry_window_s",
        "serve",
        "ckks_draw_ahead",
    },
    "tls": {"ca_cert", "cert", "key", "crl"},
    "identity": {"key", "public_key", "server_public_key"},
    "data": {"cache", "cache_dir", "classes", "backbone", "holdout"},
    "policy": {
        "min_cohort",
        "allow_exposure",
        "max_epsilon",
        "disclose_coverage",
        "disclose_row_bounds",
        "allowed_aggregation",
        "ckks_decryptor",
        "lifetime_epsilon",
        "lifetime_delta",
        "privacy_unit",
        "mask_graph_security_bits",
        "mask_assumed_colluders",
        "dp_assumed_colluders",
        "decrypt_max_rows",
        "witness_quorum",
        "decrypt_max_row_norm",
        "profile",
    },
    "retention": {"stats_days", "reports_days", "models_keep"},
}
#: Sections whose unknown keys are errors, not warnings: a misspelt protection setting
#: (``min_cohrt``) would otherwise leave the site at the default it meant to change.
_STRICT_SECTIONS = frozenset({"policy", "retention"})
_ROLES = ("participant", "decryptor")
#: Aggregation modes a site's policy can allow (docs/protocol.md §4), and the default.
AGGREGATION_NAMES = ("plaintext", "mask", "ckks")
PROTECTED_AGGREGATION = ("mask", "ckks")


class ConfigError(ValueError):
    """client.toml is missing, unreadable or invalid; the message names the file and key."""


@dataclass(frozen=True)
class LocalPolicy:
    """The site's own rules for release plans (docs/protocol.md §6); checked by :mod:`afl.client.policy.plan`.

    DP (docs/protocol.md §7): ``max_epsilon`` bounds one run (both rounds), ``lifetime_epsilon``
    at ``lifetime_delta`` everything in the site's ledger (:mod:`afl.client.policy.ledger`);
    ``privacy_unit`` "patient" refuses image-level DP plans. inf = no limit (then plans without
    DP are accepted too).

    Sparse MASK graph (docs/protocol.md §4.2): the site recomputes the graph's failure
    probability for max(the plan's colluders, ⌈``mask_assumed_colluders``·n⌉) colluders and
    refuses above 2^-``mask_graph_security_bits``.

    DP colluder floor (docs/protocol.md §7): in MASK and CKKS the site computes its ε assuming
    max(the plan's t_r, ⌈``dp_assumed_colluders``·n_r⌉) of a release's n_r members collude with
    the coordinator (default ⌈n/3⌉, as for the sparse graph), so the plan's t = 0 is not taken on
    trust.

    CKKS decryptor (docs/protocol.md §6.2): ``decrypt_max_rows`` N and ``decrypt_max_row_norm`` L
    (0 = not checked), the largest plausible site; a decrypted sum over m members outside what m
    such datasets could produce (‖Σ b_c‖ > m·2L, trace(Σ G) > m·N·L²) is not returned."""

    min_cohort: int = 3
    allow_exposure: bool = False
    max_epsilon: float = math.inf
    disclose_coverage: bool = False
    disclose_row_bounds: bool = True
    allowed_aggregation: tuple[str, ...] = PROTECTED_AGGREGATION
    ckks_decryptor: str | None = None
    lifetime_epsilon: float = math.inf
    lifetime_delta: float = 1e-5
    privacy_unit: str = "patient"
    mask_graph_security_bits: int = 40
    mask_assumed_colluders: float = 0.333
    dp_assumed_colluders: float = 0.333
    decrypt_max_rows: int = 0
    decrypt_max_row_norm: float = 0.0
    witness_quorum: int = 0  # 0: a majority of the roster (docs/protocol.md §11a, M-193)
    #: "production" (written by ``afl-client init --import``), "development" (``afl provision``
    #: demo kits) or "" (not said); informational: `afl-client doctor` prints it.
    profile: str = ""


@dataclass(frozen=True)
class TlsPaths:
    ca_cert: Path
    cert: Path
    key: Path
    #: the federation CA's revocation list; a plan with a revoked peer is refused (M-178)
    crl: Path | None = None


@dataclass(frozen=True)
class DataConfig:
    cache: Path
    classes: tuple[str, ...] = ()
    backbone: str | None = None
    holdout: Path | None = None


@dataclass(frozen=True)
class TimingConfig:
    """Polling back-off, RPC deadlines and retry budget (seconds)."""

    poll_interval_s: float = 0.2
    max_poll_interval_s: float = 2.0
    rpc_timeout_s: float = 30.0
    upload_timeout_s: float = 600.0
    max_wait_s: float = 86400.0
    linger_s: float = 5.0
    retry_attempts: int = 8
    retry_window_s: float = 180.0


@dataclass(frozen=True)
class RetentionConfig:
    """``[retention]`` (docs/operations.md §10, M-179): how long the site keeps what it can
    recompute or no longer needs; None keeps it. Enforced by the daemon at start-up and after
    each round (:mod:`afl.client.retention`)."""

    #: days a file in ``state_dir/stats/`` (its own G and b, recomputed when needed) is kept
    stats_days: float | None = None
    #: days a round report in ``state_dir/reports/`` is kept (the upload register stays)
    reports_days: float | None = None
    #: how many verified models (newest first) ``state_dir/models/`` keeps
    models_keep: int | None = None


@dataclass(frozen=True)
class ClientConfig:
    """A validated client.toml (paths resolved against the file's folder)."""

    path: Path
    site_id: str
    federation_id: str
    server_address: str
    role: str
    state_dir: Path
    tls: TlsPaths
    identity_key_path: Path
    identity_public_key: bytes
    server_public_key: bytes
    peers: Mapping[str, bytes]
    data: DataConfig
    policy: LocalPolicy = field(default_factory=LocalPolicy)
    timing: TimingConfig = field(default_factory=TimingConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    warnings: tuple[str, ...] = ()
    serve: bool = False
    #: CKKS: draw encryptions of zero while waiting for a round (docs/protocol.md M-237).
    ckks_draw_ahead: bool = True


class _Reader:
    def __init__(self, path: Path, doc: Mapping[str, Any]) -> None:
        self.path = path
        self.doc = doc
        self.warnings: list[str] = []

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: [{key.split('.')[0]}] {key}: {problem}")

    def section(self, name: str, *, required: bool = True) -> Mapping[str, Any]:
        raw = self.doc.get(name)
        if raw is None:
            if required:
                raise ConfigError(f"{self.path}: missing section [{name}]")
            return {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{self.path}: [{name}] must be a table")
        known = _KNOWN.get(name, set(raw))
        for key in sorted(set(raw) - known):
            hint = did_you_mean(key, known)
            if name in _STRICT_SECTIONS:  # a typo must not leave a protection at its default
                raise ConfigError(
                    f"{self.path}: unknown key [{name}] {key}{hint}: fix the key (the site's "
                    f"protection settings are not guessed; known keys: {', '.join(sorted(known))})"
                )
            self.warnings.append(f"{self.path}: unknown key [{name}] {key}{hint} (ignored)")
        return raw

    def string(
        self, sec: Mapping[str, Any], name: str, key: str, default: str | None = None
    ) -> str:
        value = sec.get(key, default)
        if value is None:
            raise self.error(f"{name}.{key}", "is required")
        if not isinstance(value, str) or not value.strip():
            raise self.error(f"{name}.{key}", f"must be a non-empty string, got {value!r}")
        return value

    def number(
        self, sec: Mapping[str, Any], name: str, key: str, default: float, *, minimum: float
    ) -> float:
        value = sec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise self.error(f"{name}.{key}", f"must be a number, got {value!r}")
        if value < minimum:
            raise self.error(f"{name}.{key}", f"must be >= {minimum}, got {value}")
        return float(value)

    def integer(
        self, sec: Mapping[str, Any], name: str, key: str, default: int, *, minimum: int
    ) -> int:
        value = sec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{name}.{key}", f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(f"{name}.{key}", f"must be >= {minimum}, got {value}")
        return value

    def boolean(self, sec: Mapping[str, Any], name: str, key: str, default: bool) -> bool:
        value = sec.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{name}.{key}", f"must be true or false, got {value!r}")
        return value

    def file(self, sec: Mapping[str, Any], name: str, key: str) -> Path:
        path = self.path.parent / self.string(sec, name, key)
        if not path.is_file():
            raise self.error(f"{name}.{key}", f"file {path} does not exist")
        return path

    def key_hex(self, sec: Mapping[str, Any], name: str, key: str) -> bytes:
        text = self.string(sec, name, key)
        try:
            raw = bytes.fromhex(text)
            signatures.load_public_key_raw(raw)
        except (ValueError, KeyFormatError) as exc:
            raise self.error(f"{name}.{key}", "must be a 32-byte Ed25519 key in hex") from exc
        return raw


def _policy(r: _Reader, peers: Mapping[str, bytes]) -> LocalPolicy:
    sec = r.section("policy", required=False)
    modes = sec.get("allowed_aggregation", list(PROTECTED_AGGREGATION))
    if (
        not isinstance(modes, list)
        or not modes
        or not all(m in AGGREGATION_NAMES for m in modes)
        or len(set(modes)) != len(modes)
    ):
        raise r.error(
            "policy.allowed_aggregation",
            f"must be a non-empty list of distinct modes from {list(AGGREGATION_NAMES)}, "
            f"got {modes!r}",
        )
    decryptor = None
    if "ckks_decryptor" in sec:
        decryptor = r.string(sec, "policy", "ckks_decryptor")
        if decryptor not in peers:
            raise r.error(
                "policy.ckks_decryptor",
                f"{decryptor!r} has no identity key in [peers]; the pinned decryptor must be one",
            )
    max_epsilon = r.number(sec, "policy", "max_epsilon", math.inf, minimum=0.0)
    lifetime_epsilon = r.number(sec, "policy", "lifetime_epsilon", math.inf, minimum=0.0)
    return LocalPolicy(
        min_cohort=r.integer(sec, "policy", "min_cohort", 3, minimum=1),
        allow_exposure=r.boolean(sec, "policy", "allow_exposure", False),
        max_epsilon=max_epsilon,
        disclose_coverage=r.boolean(sec, "policy", "disclose_coverage", False),
        disclose_row_bounds=_row_bounds(r, sec, modes, dp=min(max_epsilon, lifetime_epsilon)),
        allowed_aggregation=tuple(modes),
        ckks_decryptor=decryptor,
        lifetime_epsilon=lifetime_epsilon,
        lifetime_delta=_lifetime_delta(r, sec),
        privacy_unit=_privacy_unit(r, sec),
        mask_graph_security_bits=r.integer(
            sec, "policy", "mask_graph_security_bits", 40, minimum=1
        ),
        mask_assumed_colluders=_assumed_colluders(r, sec, "mask_assumed_colluders"),
        dp_assumed_colluders=_assumed_colluders(r, sec, "dp_assumed_colluders"),
        decrypt_max_rows=r.integer(sec, "policy", "decrypt_max_rows", 0, minimum=0),
        witness_quorum=r.integer(sec, "policy", "witness_quorum", 0, minimum=0),
        decrypt_max_row_norm=r.number(sec, "policy", "decrypt_max_row_norm", 0.0, minimum=0.0),
        profile=_profile(r, sec),
    )


def _profile(r: _Reader, sec: Mapping[str, Any]) -> str:
    if "profile" not in sec:
        return ""
    value = r.string(sec, "policy", "profile")
    if value not in ("production", "development"):
        raise r.error("policy.profile", f"must be 'production' or 'development', got {value!r}")
    return value


def _row_bounds(r: _Reader, sec: Mapping[str, Any], modes: list[str], *, dp: float) -> bool:
    """``disclose_row_bounds`` (docs/protocol.md §4.2 "Declared bounds"): the row count and the
    largest row norm at enrolment, rounded up to powers of two, are a release outside any DP
    budget, so a site whose policy requires DP (a finite ``max_epsilon`` or
    ``lifetime_epsilon``: it refuses every plan without DP, and a DP plan takes N from
    ``[round.dp] max_samples``) never sends them: without the key they are off, and ``true`` is
    an error. Otherwise, without the key, they are sent only when the site allows ``mask`` or
    ``ckks`` (the modes whose plans are sized by them); ``plaintext`` needs none."""
    if "disclose_row_bounds" not in sec:
        return math.isinf(dp) and any(m in PROTECTED_AGGREGATION for m in modes)
    value = r.boolean(sec, "policy", "disclose_row_bounds", False)
    if value and math.isfinite(dp):
        raise r.error(
            "policy.disclose_row_bounds",
            "must be false when max_epsilon or lifetime_epsilon is finite: the row count and "
            "largest row norm would leave the site outside its DP budget (a DP run takes N from "
            "the server's [round.dp] max_samples)",
        )
    return value


def _assumed_colluders(r: _Reader, sec: Mapping[str, Any], key: str) -> float:
    value = r.number(sec, "policy", key, 0.333, minimum=0.0)
    if not value < 1:
        raise r.error(f"policy.{key}", f"must lie in [0, 1), got {value}")
    return value


def _lifetime_delta(r: _Reader, sec: Mapping[str, Any]) -> float:
    value = r.number(sec, "policy", "lifetime_delta", 1e-5, minimum=0.0)
    if not 0 < value < 1:
        raise r.error("policy.lifetime_delta", f"must lie in (0, 1), got {value}")
    return value


def _privacy_unit(r: _Reader, sec: Mapping[str, Any]) -> str:
    value = r.string(sec, "policy", "privacy_unit", "patient")
    if value not in ("patient", "image"):
        raise r.error("policy.privacy_unit", f"must be 'patient' or 'image', got {value!r}")
    return value


def _data(r: _Reader) -> DataConfig:
    sec = r.section("data")
    if "cache" in sec and "cache_dir" in sec:
        raise r.error("data.cache", "give either cache or cache_dir, not both")
    cache_key = "cache" if "cache" in sec else "cache_dir"
    classes = sec.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
        raise r.error("data.classes", f"must be a list of class names, got {classes!r}")
    if len(set(classes)) != len(classes):
        raise r.error("data.classes", "lists a class twice")
    backbone = sec.get("backbone")
    if backbone is not None and (not isinstance(backbone, str) or not backbone):
        raise r.error("data.backbone", f"must be a non-empty string, got {backbone!r}")
    holdout = sec.get("holdout")
    if holdout is not None and (not isinstance(holdout, str) or not holdout):
        raise r.error("data.holdout", f"must be the path of a feature cache, got {holdout!r}")
    return DataConfig(
        cache=r.path.parent / r.string(sec, "data", cache_key),
        classes=tuple(classes),
        backbone=backbone,
        holdout=None if holdout is None else r.path.parent / holdout,
    )


def _timing(r: _Reader, sec: Mapping[str, Any]) -> TimingConfig:
    poll = r.number(sec, "client", "poll_interval_s", 0.2, minimum=0.001)
    return TimingConfig(
        poll_interval_s=poll,
        max_poll_interval_s=r.number(sec, "client", "max_poll_interval_s", 2.0, minimum=poll),
        rpc_timeout_s=r.number(sec, "client", "rpc_timeout_s", 30.0, minimum=0.1),
        upload_timeout_s=r.number(sec, "client", "upload_timeout_s", 600.0, minimum=0.1),
        max_wait_s=r.number(sec, "client", "max_wait_s", 86400.0, minimum=0.0),
        linger_s=r.number(sec, "client", "linger_s", 5.0, minimum=0.0),
        retry_attempts=r.integer(sec, "client", "retry_attempts", 8, minimum=1),
        retry_window_s=r.number(sec, "client", "retry_window_s", 180.0, minimum=0.0),
    )


def _retention(r: _Reader) -> RetentionConfig:
    sec = r.section("retention", required=False)
    days = {
        key: r.number(sec, "retention", key, 0.0, minimum=0.0) if key in sec else None
        for key in ("stats_days", "reports_days")
    }
    keep = (
        r.integer(sec, "retention", "models_keep", 1, minimum=1) if "models_keep" in sec else None
    )
    return RetentionConfig(days["stats_days"], days["reports_days"], keep)


def load_client_config(path: str | os.PathLike[str]) -> ClientConfig:
    """Read and validate ``client.toml``; :class:`ConfigError` names the offending key."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"{p}: no such config file") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read TOML ({exc})") from exc
    r = _Reader(p.resolve(), doc)
    client = r.section("client")
    tls = r.section("tls")
    ident = r.section("identity")
    role = r.string(client, "client", "role", "participant")
    if role not in _ROLES:
        raise r.error("client.role", f"must be one of {_ROLES}, got {role!r}")
    peers_raw = r.section("peers", required=False)
    peers: dict[str, bytes] = {}
    for site in peers_raw:
        peers[site] = r.key_hex(peers_raw, "peers", site)
    identity_key_path = r.file(ident, "identity", "key")
    public = r.key_hex(ident, "identity", "public_key")
    try:
        private = signatures.load_private_key_pem(identity_key_path.read_bytes())
    except (OSError, KeyFormatError) as exc:
        raise r.error("identity.key", f"cannot load the Ed25519 identity key ({exc})") from exc
    if signatures.public_key_to_raw(private) != public:
        raise r.error("identity.public_key", "does not match the identity key file")
    site_id = r.string(client, "client", "site_id")
    if site_id in peers and peers[site_id] != public:
        raise r.error("peers", f"lists a different identity key for this site {site_id!r}")
    config = ClientConfig(
        path=r.path,
        site_id=site_id,
        federation_id=r.string(client, "client", "federation_id"),
        server_address=r.string(client, "client", "server"),
        role=role,
        state_dir=r.path.parent / r.string(client, "client", "state_dir", "state"),
        tls=TlsPaths(
            ca_cert=r.file(tls, "tls", "ca_cert"),
            cert=r.file(tls, "tls", "cert"),
            key=r.file(tls, "tls", "key"),
            crl=r.path.parent / r.string(tls, "tls", "crl") if "crl" in tls else None,
        ),
        identity_key_path=identity_key_path,
        identity_public_key=public,
        server_public_key=r.key_hex(ident, "identity", "server_public_key"),
        peers=peers,
        # The CKKS decryptor holds no data (docs/protocol.md §1): [data] is optional for it.
        data=_data(r) if role == "participant" or "data" in doc else DataConfig(r.path.parent),
        policy=_policy(r, peers),
        timing=_timing(r, client),
        retention=_retention(r),
        serve=r.boolean(client, "client", "serve", False),
        ckks_draw_ahead=r.boolean(client, "client", "ckks_draw_ahead", True),
    )
    return ClientConfig(**{**config.__dict__, "warnings": tuple(r.warnings)})
