"""server.toml: load and validate the afl-server configuration.

Every table and key, with its default and meaning, is in ``deploy/server.example.toml`` (loaded
by this module in ``tests/test_deploy_files.py``); what an operator sets and why is in
docs/operations.md, and the protocol each setting drives in docs/protocol.md. A key or table this
loader does not read is refused with a did-you-mean hint, so a typo never silently leaves a
protection at its default; relative paths are resolved against the file's folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afl.core.aggregation import GRAM_SCOPES, GramScope
from afl.core.refinement import RefinementParams
from afl.core.suggest import did_you_mean
from afl.crypto.identity import pki
from afl.crypto.identity.custody import RosterSite
from afl.crypto.secagg.graph_bounds import SECURITY_BITS
from afl.server.errors import ConfigError
from afl.server.limits import StreamLimits
from afl.server.plan.dp import DpSettings, dp_settings_from_table
from afl.server.solve.gate import GateSettings, gate_settings_from_table

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_MAX_UPLOAD_BYTES",
    "MaskSettings",
    "RoundSettings",
    "ServerConfig",
    "load_config",
    "merged_run_table",
    "round_template",
    "run_settings",
    "settings_table",
]

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_UPLOAD_BYTES = 256 << 20
AGGREGATIONS = ("plaintext", "mask", "ckks")
EVAL_CALIBRATIONS = ("platt", "isotonic", "none")
MASK_GRAPHS = ("full", "sparse")
#: Sparse masking graph: colluders assumed (fraction of the participants, rounded up) and drop-outs
#: tolerated (rounded down) when k and t_N are chosen (docs/protocol.md §4.2 "Sparse graph").
DEFAULT_COLLUDER_FRACTION = 0.333
DEFAULT_DROPOUT_FRACTION = 0.05
_TABLES = (
    "server",
    "tls",
    "identity",
    "limits",
    "sites",
    "round",
    "ckks",
    "admins",
    "retention",
    "access",
)
ROLES = ("participant", "decryptor")


def round_template(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The [round] table ``afl provision`` writes: defaults, updated with ``overrides``."""
    table: dict[str, Any] = {
        "classes": [],
        "feature_dim": 0,
        "backbone": "",
        "backbone_sha256": "",
        "allow_random_init": False,
        "gamma": 1.0,
        "gram_scope": "global",
        "aggregation": "plaintext",
        "rounds": 1,
        "tau": 0.7,
        "alpha": 0.5,
        "delta_pos": 5,
        "delta_neg": 50,
        "min_participants": 3,
        "participants": [],
        "enrol_timeout_s": 600.0,
        "upload_timeout_s": 600.0,
        "operator_override": False,
        "override_reason": "",
        "mask_threshold": 0,
        "mask_feature_norm": 0.0,
        "mask_max_samples": 0,
        "mask_gram_bound": 0.0,
        "mask_vector_bound": 0.0,
        "mask_graph": "full",
        "mask_colluder_fraction": DEFAULT_COLLUDER_FRACTION,
        "mask_dropout_fraction": DEFAULT_DROPOUT_FRACTION,
        "mask_security_bits": SECURITY_BITS,
        "ckks_gram_bound": 1.0e6,
        "ckks_vector_bound": 1.0e3,
        "evaluate": False,
        "eval_calibration": "platt",
        "eval_max_rows": 0,
    }
    for key, value in (overrides or {}).items():
        if key not in table:
            raise ConfigError(f"unknown [round] setting {key!r}; known: {', '.join(table)}")
        table[key] = list(value) if isinstance(value, tuple) else value
    return table


@dataclass(frozen=True)
class MaskSettings:
    """MASK mode's bounds (docs/protocol.md §4.2): per-site |G_ij| <= gram_bound (default
    max_samples · feature_norm², since |h_i·h_j| <= L² for ‖h‖ <= L), |b_j| <= vector_bound
    (default 2 · feature_norm: a balanced class vector is a difference of two means of rows), and
    the Shamir threshold t (0 = a majority of the participants). A bound left at 0 comes from the
    maxima the sites declared at enrolment (:mod:`afl.core.row_bounds`), per release. ``graph``
    "sparse" masks each site with its neighbours of a random Harary graph whose degree is chosen
    for ``colluder_fraction`` colluders, ``dropout_fraction`` drop-outs (then t = n - D) and a
    failure probability of at most 2^-``security_bits`` (:mod:`afl.crypto.secagg.graph_bounds`)."""

    gram_bound: float = 0.0
    vector_bound: float = 0.0
    threshold: int = 0
    max_samples: int = 0  # N, declared rows per site (DP + mask bounds, afl.server.plan.dp_mask)
    graph: str = "full"
    colluder_fraction: float = DEFAULT_COLLUDER_FRACTION
    dropout_fraction: float = DEFAULT_DROPOUT_FRACTION
    security_bits: int = SECURITY_BITS

    @property
    def source(self) -> str:
        """Where the bounds come from, for logs and `afl-server check`."""
        if self.gram_bound and self.vector_bound:
            return (
                f"server.toml (Gram {self.gram_bound:.6g}, class vectors {self.vector_bound:.6g})"
            )
        return "the sites' declared row counts and row norms (at enrolment), per release"


def _mask_settings(t: _Table) -> MaskSettings:
    norm = float(t.get("mask_feature_norm", (int, float), 0.0))
    samples = t.get("mask_max_samples", int, 0)
    gram = float(t.get("mask_gram_bound", (int, float), 0.0))
    vector = float(t.get("mask_vector_bound", (int, float), 0.0))
    threshold = t.get("mask_threshold", int, 0)
    if min(norm, samples, gram, vector, threshold) < 0 or not math.isfinite(norm + gram + vector):
        raise t.fail("mask_*", "mask bounds and threshold must be finite and >= 0")
    graph = t.get("mask_graph", str, "full")
    if graph not in MASK_GRAPHS:
        raise t.fail("mask_graph", f"must be one of {MASK_GRAPHS}, got {graph!r}")
    colluders = float(t.get("mask_colluder_fraction", (int, float), DEFAULT_COLLUDER_FRACTION))
    dropouts = float(t.get("mask_dropout_fraction", (int, float), DEFAULT_DROPOUT_FRACTION))
    if not 0.0 <= colluders < 1.0 or not 0.0 <= dropouts < 0.5 or colluders + 2 * dropouts >= 1:
        raise t.fail(
            "mask_colluder_fraction",
            f"colluders {colluders!r} and drop-outs {dropouts!r} (fractions of the participants) "
            "need colluders + 2·drop-outs < 1 (docs/protocol.md §4.2)",
        )
    bits = t.get("mask_security_bits", int, SECURITY_BITS)
    if not 1 <= bits <= 128:
        raise t.fail("mask_security_bits", f"must lie in 1..128, got {bits}")
    if graph == "sparse" and threshold:
        raise t.fail("mask_threshold", "a sparse graph sets t = n - D itself; leave it at 0")
    return MaskSettings(
        gram_bound=gram or samples * norm * norm,
        vector_bound=vector or 2.0 * norm,
        threshold=threshold,
        max_samples=samples,
        graph=graph,
        colluder_fraction=colluders,
        dropout_fraction=dropouts,
        security_bits=bits,
    )


@dataclass(frozen=True)
class RoundSettings:
    """The validated [round] table."""

    classes: tuple[str, ...]
    feature_dim: int
    backbone: str
    gamma: float
    gram_scope: GramScope
    aggregation: str
    rounds: int
    refinement: RefinementParams
    min_participants: int
    participants: tuple[str, ...]
    enrol_timeout_s: float
    upload_timeout_s: float
    operator_override: bool = False
    override_reason: str = ""
    mask: MaskSettings | None = None
    ckks_gram_bound: float = 1.0e6
    ckks_vector_bound: float = 1.0e3
    dp: DpSettings | None = None
    backbone_sha256: str = ""
    allow_random_init: bool = False
    evaluate: bool = False
    eval_calibration: str = "platt"
    eval_max_rows: int = 0
    gate: GateSettings | None = None


@dataclass(frozen=True)
class ServerConfig:
    """Everything afl-server reads from server.toml."""

    path: Path
    federation_id: str
    listen: str
    state_dir: Path
    ca_cert: Path
    cert: Path
    key: Path
    identity_key: Path
    identity_public_key: bytes
    sites: Mapping[str, RosterSite]
    round: RoundSettings
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    ckks_public_context: Path | None = None
    admins: tuple[str, ...] = ()
    #: [tls] crl: the federation CA's revocation list (afl ca revoke); None: nothing revoked.
    crl: Path | None = None
    payload_retention_days: float = 0.0
    limits: StreamLimits = field(default_factory=StreamLimits)
    # Seconds a server that refuses its state keeps answering sites with the reason before it
    # exits 2 (afl.server.daemon.refusal); 0: exit at once.
    refusal_serve_s: float = 60.0
    # Seconds a stage stays open after an upload refused for a full disk (the sites retry it for
    # their retry_window_s, default 180).
    full_disk_hold_s: float = 180.0
    # [access] need_to_know: a run's model and evaluation go to the run's participants only
    # (docs/protocol.md M-160); off, to every enrolled site.
    need_to_know: bool = True


class _Table:
    """Typed access to one TOML table with errors that name the file, table and key."""

    def __init__(self, data: Mapping[str, Any], name: str, source: Path) -> None:
        self.data, self.name, self.source = data, name, source
        self.seen: set[str] = set()

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: [{self.name}] {key}: {problem}")

    def refuse_unknown(self, known: Collection[str] = ()) -> None:
        """Refuse keys never read and not ``known`` (call after reading): typos must not pass."""
        valid = self.seen | set(known)
        for key in sorted(set(self.data) - valid):
            raise self.fail(
                key, f"unknown key{did_you_mean(key, valid)}; see deploy/server.example.toml"
            )

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is None:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        bad_bool = isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,)
        )
        if bad_bool or not isinstance(value, kind):
            raise self.fail(key, f"expected {_kind_name(kind)}, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None, *, positive: bool = True) -> float:
        value = float(self.get(key, (int, float), default))
        if not math.isfinite(value) or (positive and value <= 0):
            raise self.fail(key, f"must be a finite positive number, got {value!r}")
        return value

    def strings(self, key: str, default: list[str] | None = None) -> tuple[str, ...]:
        values = self.get(key, list, default)
        if not all(isinstance(v, str) and v for v in values):
            raise self.fail(key, "must be a list of non-empty strings")
        if len(set(values)) != len(values):
            raise self.fail(key, "lists a value twice")
        return tuple(values)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _table(doc: Mapping[str, Any], name: str, source: Path) -> _Table:
    value = doc.get(name)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: missing table [{name}]")
    return _Table(value, name, source)


def _stream_limits(limits: _Table) -> StreamLimits:
    """The per-site stream limits of [limits] (:class:`afl.server.limits.StreamLimits`)."""
    default = StreamLimits()
    counts = {}
    for key in ("watch_streams_per_site", "uploads_per_site", "downloads_per_site"):
        counts[key] = limits.get(key, int, getattr(default, key))
        if counts[key] < 1:
            raise limits.fail(key, f"must be >= 1, got {counts[key]}")
    workers = limits.get("worker_threads", int, default.worker_threads)
    if workers < 0:
        raise limits.fail(
            "worker_threads", f"must be >= 0 (0 = sized from the sites), got {workers}"
        )
    return StreamLimits(
        **counts,
        upload_idle_timeout_s=limits.number("upload_idle_timeout_s", default.upload_idle_timeout_s),
        worker_threads=workers,
    )


def _hex_key(table: _Table, key: str) -> bytes:
    text = table.get(key, str)
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise table.fail(key, "must be hex") from exc
    if len(raw) != 32:
        raise table.fail(key, "must be a 32-byte Ed25519 public key in hex")
    return raw


def _sites(doc: Mapping[str, Any], source: Path) -> dict[str, RosterSite]:
    raw = doc.get("sites")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: [sites] must list at least one provisioned site")
    sites: dict[str, RosterSite] = {}
    for site_id, entry in raw.items():
        try:
            pki.validate_site_id(site_id)
        except pki.PkiError as exc:
            raise ConfigError(f"{source}: [sites] {exc}") from exc
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: [sites.{site_id}] must be a table")
        table = _Table(entry, f"sites.{site_id}", source)
        role = table.get("role", str, "participant")
        if role not in ROLES:
            raise table.fail("role", f"must be one of {ROLES}, got {role!r}")
        sites[site_id] = RosterSite(_hex_key(table, "identity_public_key"), role)
        table.refuse_unknown()
    return sites


def _dp_settings(t: _Table) -> DpSettings | None:
    """The optional [round.dp] table (DP mode, :mod:`afl.server.plan.dp`)."""
    if "dp" not in t.data:
        return None
    table = t.get("dp", dict)
    try:
        return dp_settings_from_table(table)
    except ValueError as exc:
        raise t.fail("dp", str(exc)) from exc


def _gate_settings(t: _Table) -> GateSettings | None:
    """The optional [round.gate] table (the validation gate, :mod:`afl.server.solve.gate`)."""
    if "gate" not in t.data:
        return None
    try:
        return gate_settings_from_table(t.get("gate", dict))
    except ValueError as exc:
        raise t.fail("gate", str(exc)) from exc


def run_settings(
    table: Mapping[str, Any], *, source: str | Path, sites: Mapping[str, RosterSite]
) -> RoundSettings:
    """Validate the settings of one run: the keys of a [round] table (server.toml's, or a table
    submitted with ``afl admin submit``); :class:`ConfigError` names the key and the problem."""
    return _round({"round": dict(table)}, Path(source), sites)


def settings_table(settings: RoundSettings) -> dict[str, Any]:
    """The [round] table that :func:`run_settings` turns back into ``settings`` (how a run's
    settings are stored and shown)."""
    r = settings.refinement
    table: dict[str, Any] = {
        "classes": list(settings.classes),
        "feature_dim": settings.feature_dim,
        "backbone": settings.backbone,
        "gamma": settings.gamma,
        "gram_scope": settings.gram_scope,
        "aggregation": settings.aggregation,
        "rounds": settings.rounds,
        "tau": r.tau,
        "alpha": r.alpha,
        "delta_pos": r.delta_pos,
        "delta_neg": r.delta_neg,
        "min_participants": settings.min_participants,
        "participants": list(settings.participants),
        "enrol_timeout_s": settings.enrol_timeout_s,
        "upload_timeout_s": settings.upload_timeout_s,
        "operator_override": settings.operator_override,
        "override_reason": settings.override_reason,
        "ckks_gram_bound": settings.ckks_gram_bound,
        "ckks_vector_bound": settings.ckks_vector_bound,
        "backbone_sha256": settings.backbone_sha256,
        "allow_random_init": settings.allow_random_init,
        "evaluate": settings.evaluate,
        "eval_calibration": settings.eval_calibration,
        "eval_max_rows": settings.eval_max_rows,
    }
    if settings.mask is not None:
        table.update(
            mask_gram_bound=settings.mask.gram_bound,
            mask_vector_bound=settings.mask.vector_bound,
            mask_threshold=settings.mask.threshold,
            mask_max_samples=settings.mask.max_samples,
            mask_graph=settings.mask.graph,
            mask_colluder_fraction=settings.mask.colluder_fraction,
            mask_dropout_fraction=settings.mask.dropout_fraction,
            mask_security_bits=settings.mask.security_bits,
        )
    if settings.dp is not None:
        table["dp"] = dataclasses.asdict(settings.dp)
    if settings.gate is not None:
        table["gate"] = dataclasses.asdict(settings.gate)
    return table


def merged_run_table(base: RoundSettings, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A submitted run's [round] table: ``base`` (server.toml's) updated with ``overrides``
    (tables such as ``dp`` are replaced whole; the base's ``mask_*`` keys are dropped when the
    submission sets its own or another aggregation mode)."""
    table = settings_table(base)
    if overrides.get("aggregation", base.aggregation) != base.aggregation or any(
        k.startswith("mask_") for k in overrides
    ):
        table = {k: v for k, v in table.items() if not k.startswith("mask_")}
    table.update(overrides)
    return table


def _round(doc: Mapping[str, Any], source: Path, sites: Mapping[str, RosterSite]) -> RoundSettings:
    t = _table(doc, "round", source)
    classes = t.strings("classes")
    if not classes:
        raise t.fail("classes", "list the class names in model column order")
    d = t.get("feature_dim", int)
    if d < 1:
        raise t.fail("feature_dim", f"set d, the feature dimension (>= 1), got {d}")
    scope = t.get("gram_scope", str, "global")
    if scope not in GRAM_SCOPES:
        raise t.fail("gram_scope", f"must be one of {GRAM_SCOPES}, got {scope!r}")
    aggregation = t.get("aggregation", str, "plaintext")
    if aggregation not in AGGREGATIONS:
        raise t.fail("aggregation", f"must be one of {AGGREGATIONS} for now, got {aggregation!r}")
    decryptors = [s for s, e in sites.items() if e.role == "decryptor"]
    if aggregation == "ckks" and len(decryptors) != 1:
        raise t.fail(
            "aggregation",
            "'ckks' needs exactly one site with role = \"decryptor\" in [sites] "
            f"(afl provision --decryptor), found {len(decryptors)}",
        )
    rounds = t.get("rounds", int, 1)
    if rounds not in (1, 2):
        raise t.fail("rounds", f"must be 1 or 2, got {rounds}")
    try:
        refinement = RefinementParams(
            tau=t.number("tau", 0.7),
            alpha=float(t.get("alpha", (int, float), 0.5)),
            delta_pos=t.get("delta_pos", int, 5),
            delta_neg=t.get("delta_neg", int, 50),
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: [round] refinement: {exc}") from exc
    # The CKKS decryptor holds no data (docs/protocol.md §1): not a participant by default, never one.
    data_sites = tuple(sorted(s for s, e in sites.items() if e.role != "decryptor"))
    participants = t.strings("participants", []) or data_sites
    if any(sites[s].role == "decryptor" for s in participants if s in sites):
        raise t.fail("participants", "the CKKS decryptor site holds no data; do not list it")
    unknown = sorted(set(participants) - set(sites))
    if unknown:
        raise t.fail("participants", f"not provisioned in [sites]: {', '.join(unknown)}")
    min_participants = t.get("min_participants", int, min(3, len(participants)))
    if not 1 <= min_participants <= len(participants):
        raise t.fail(
            "min_participants",
            f"must lie in 1..{len(participants)} (participants), got {min_participants}",
        )
    mask = _mask_settings(t) if aggregation == "mask" else None
    if mask is not None and mask.graph == "sparse" and scope != "global":
        raise t.fail(
            "mask_graph",
            "a sparse graph masks releases over every participant only: use gram_scope = 'global'",
        )
    dp = _dp_settings(t)
    if dp is not None and aggregation == "ckks" and dp.max_samples < 1:
        raise t.fail(
            "dp",
            "DP with aggregation = 'ckks' needs max_samples (N, the largest site's rows): the "
            "encrypted DP statistics are bounded by N·L², N·L and N (docs/protocol.md §7)",
        )
    evaluate = t.get("evaluate", bool, False)
    if evaluate and dp is not None and not dp.eval_epsilon > 0:
        raise t.fail(
            "evaluate",
            "a run with [round.dp] evaluates its model only under DP: set [round.dp] "
            "eval_epsilon (the evaluation round's ε per site, docs/protocol.md §6.1), or set "
            "evaluate = false",
        )
    gate = _gate_settings(t)
    if gate is not None and dp is not None:
        raise t.fail(
            "gate",
            "a run with [round.dp] cannot use the validation gate yet: the gate's evaluation "
            "releases carry no DP noise (docs/protocol.md §6.2)",
        )
    calibration = t.get("eval_calibration", str, "platt")
    if calibration not in EVAL_CALIBRATIONS:
        raise t.fail("eval_calibration", f"must be one of {EVAL_CALIBRATIONS}, got {calibration!r}")
    eval_max_rows = t.get("eval_max_rows", int, 0)
    if eval_max_rows < 0:
        raise t.fail(
            "eval_max_rows", f"must be >= 0 (0 = the sites' declared rows), got {eval_max_rows}"
        )
    digest = t.get("backbone_sha256", str, "").strip().lower()
    if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        raise t.fail("backbone_sha256", f'must be 64 hex digits (or ""), got {digest!r}')
    settings = RoundSettings(
        classes=classes,
        feature_dim=d,
        backbone=t.get("backbone", str, ""),
        gamma=t.number("gamma", 1.0),
        gram_scope=scope,
        aggregation=aggregation,
        rounds=rounds,
        refinement=refinement,
        min_participants=min_participants,
        participants=tuple(sorted(participants)),
        enrol_timeout_s=t.number("enrol_timeout_s", 600.0),
        upload_timeout_s=t.number("upload_timeout_s", 600.0),
        operator_override=t.get("operator_override", bool, False),
        override_reason=t.get("override_reason", str, ""),
        mask=mask,
        ckks_gram_bound=t.number("ckks_gram_bound", 1.0e6),
        ckks_vector_bound=t.number("ckks_vector_bound", 1.0e3),
        dp=dp,
        backbone_sha256=digest,
        allow_random_init=t.get("allow_random_init", bool, False),
        evaluate=evaluate,
        eval_calibration=calibration,
        eval_max_rows=eval_max_rows,
        gate=gate,
    )
    t.refuse_unknown(known=[*round_template(), "dp", "gate"])
    return settings


def _retention_days(table: _Table) -> float:
    days = table.number("payload_days", 0.0, positive=False)
    if days < 0:
        raise table.fail("payload_days", f"must be >= 0, got {days}")
    return days


def load_config(path: str | os.PathLike[str]) -> ServerConfig:
    """Read and validate ``path``; :class:`ConfigError` says which key is wrong and why."""
    source = Path(path)
    try:
        with source.open("rb") as handle:
            doc = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read server config {source}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    base = source.resolve().parent
    server = _table(doc, "server", source)
    tls = _table(doc, "tls", source)
    identity = _table(doc, "identity", source)
    limits = _Table(doc.get("limits", {}), "limits", source)
    sites = _sites(doc, source)

    def file(table: _Table, key: str) -> Path:
        resolved = base / str(table.get(key, str))
        if not resolved.is_file():
            raise table.fail(key, f"file {resolved} does not exist")
        return resolved

    unknown_tables = sorted(set(doc) - set(_TABLES))
    if unknown_tables:
        name = unknown_tables[0]
        raise ConfigError(f"{source}: unknown table [{name}]{did_you_mean(name, _TABLES)}")
    metrics_port = server.get("metrics_port", int, 0)
    if not 0 <= metrics_port <= 65535:
        raise server.fail("metrics_port", f"must be in 0..65535, got {metrics_port}")
    metrics_address = server.get("metrics_address", str, "127.0.0.1")
    refusal_serve_s = float(server.get("refusal_serve_s", (int, float), 60.0))
    if refusal_serve_s < 0:
        raise server.fail("refusal_serve_s", f"must be >= 0, got {refusal_serve_s:g}")
    full_disk_hold_s = float(limits.get("full_disk_hold_s", (int, float), 180.0))
    if full_disk_hold_s < 0:
        raise limits.fail("full_disk_hold_s", f"must be >= 0, got {full_disk_hold_s:g}")
    max_chunk = limits.get("max_chunk_bytes", int, DEFAULT_MAX_CHUNK_BYTES)
    max_upload = limits.get("max_upload_bytes", int, DEFAULT_MAX_UPLOAD_BYTES)
    if max_chunk < 1 or max_upload < max_chunk:
        raise limits.fail("max_upload_bytes", "need 1 <= max_chunk_bytes <= max_upload_bytes")
    ckks = _Table(doc.get("ckks", {}), "ckks", source)
    ckks_context = file(ckks, "public_context") if "public_context" in doc.get("ckks", {}) else None
    admins_table = _Table(doc.get("admins", {}), "admins", source)
    admins = admins_table.strings("names", [])
    retention = _Table(doc.get("retention", {}), "retention", source)
    access = _Table(doc.get("access", {}), "access", source)
    federation_id = server.get("federation_id", str)
    if not federation_id.strip():
        raise server.fail("federation_id", "must not be empty")
    config = ServerConfig(
        path=source,
        federation_id=federation_id,
        listen=server.get("listen", str),
        state_dir=base / server.get("state_dir", str, "state"),
        ca_cert=file(tls, "ca_cert"),
        cert=file(tls, "cert"),
        key=file(tls, "key"),
        crl=file(tls, "crl") if "crl" in doc.get("tls", {}) else None,
        identity_key=file(identity, "key"),
        identity_public_key=_hex_key(identity, "public_key"),
        sites=sites,
        round=_round(doc, source, sites),
        admins=admins,
        payload_retention_days=_retention_days(retention),
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        max_chunk_bytes=max_chunk,
        max_upload_bytes=max_upload,
        ckks_public_context=ckks_context,
        limits=_stream_limits(limits),
        refusal_serve_s=refusal_serve_s,
        full_disk_hold_s=full_disk_hold_s,
        need_to_know=access.get("need_to_know", bool, True),
    )
    for table in (server, tls, identity, limits, ckks, admins_table, retention, access):
        table.refuse_unknown()
    return config
