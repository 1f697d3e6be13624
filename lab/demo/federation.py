"""A real federation on loopback: provisioned kits, site feature caches, and ``afl-server`` plus
one ``afl-client run`` process per site over mutual TLS (used by ``afl demo`` and the
end-to-end tests).

Kits come from the all-in-one :func:`afl.ops.provisioning.provision` (demo and tests), or with
``production=True`` from the production path run by each party in its own folder
(:func:`provision_distributed`: CA, coordinator and every site make their own keys; the operator
signs requests; sites import the public bundles), so no site's private key is ever written
outside its kit folder (docs/protocol.md M-70).

Task heterogeneity (docs/method.md §2) is written into the data the way a hospital would hold it: a
site's cache carries -1 labels for the classes it does not annotate, and its client.toml lists the
classes it labels. Nothing here computes the model: the daemons do.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.kit import import_bundle, init_site_kit
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.ops.provisioning import (
    ProvisionedFederation,
    init_ca,
    init_server_kit,
    provision,
    sign_requests,
    site_policy,
)
from afl.server import toml_text
from afl.server.config import round_template

__all__ = [
    "LISTENING",
    "LoopbackFederation",
    "LoopbackRun",
    "await_listening",
    "ckks_round_settings",
    "free_port",
    "mask_round_settings",
    "prepare_labelled_everywhere",
    "prepare_loopback",
    "provision_distributed",
    "run_loopback",
    "site_reports",
]

# Quick polling for a loopback run (a hospital deployment keeps client.toml's defaults). A short
# linger: the coordinator opens a round's successor (next round, evaluation or gate round, or the
# replacement of an aborted round) in the same locked transition that ends the round
# (afl.server.rounds: advance, _abort), so a site that sees the end sees its successor too; the
# linger only lets the site witness the run's last checkpoints before it exits, and a longer one
# would keep every loopback federation alive seconds after its run finished.
DEMO_CLIENT_TIMING: dict[str, float] = {
    "poll_interval_s": 0.05,
    "max_poll_interval_s": 0.5,
    "linger_s": 1.0,
    "max_wait_s": 600.0,
}


@dataclass(frozen=True)
class LoopbackFederation:
    """Where :func:`prepare_loopback` put the kits, caches and configs."""

    root: Path
    provisioned: ProvisionedFederation
    site_ids: tuple[str, ...]
    classes: tuple[str, ...]
    server_config: Path
    client_configs: Mapping[str, Path]
    test_cache: Path
    decryptor_config: Path | None = None


@dataclass(frozen=True)
class LoopbackRun:
    """Exit codes, the sites' local reports (round id -> report) and the wall time."""

    server_rc: int | None
    client_rcs: Mapping[str, int]
    reports: Mapping[str, dict[str, dict[str, Any]]]
    wall_s: float
    logs: Mapping[str, Path] = field(default_factory=dict)

    def final_report(self, site: str) -> dict[str, Any]:
        """The site's report of its last round (by round number, then file time)."""
        reports = list(self.reports.get(site, {}).values())
        if not reports:
            raise KeyError(f"site {site} wrote no report")
        return max(reports, key=lambda r: (r.get("outcome") == "COMPLETED", r.get("_mtime", 0)))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mask_round_settings(
    site_features: Sequence[NDArray[Any]], *, headroom: float = 1.05
) -> dict[str, toml_text.TomlValue]:
    """[round] settings of ``aggregation = "mask"`` with the bounds an operator declares for
    these caches (docs/protocol.md §4.2): L = the largest feature-row norm and N = the largest site,
    each with ``headroom``; the server derives the Gram bound N·L² and the class-vector bound 2L."""
    norm = max(
        float(np.linalg.norm(np.asarray(f, dtype=np.float64), axis=1).max()) for f in site_features
    )
    samples = max(int(f.shape[0]) for f in site_features)
    return {
        "aggregation": "mask",
        "mask_feature_norm": norm * headroom,
        "mask_max_samples": int(np.ceil(samples * headroom)),
    }


def ckks_round_settings(
    site_features: Sequence[NDArray[Any]], *, headroom: float = 1.05
) -> dict[str, toml_text.TomlValue]:
    """[round] settings of ``aggregation = "ckks"`` (docs/protocol.md §4.3): the declared bounds on
    any entry of one site's Gram, N·L² (|h_i·h_j| <= L² per row), and class vector, 2L (a difference
    of two means of rows), with L the largest feature-row norm and N the largest site, each with
    ``headroom``."""
    norm = headroom * max(
        float(np.linalg.norm(np.asarray(f, dtype=np.float64), axis=1).max()) for f in site_features
    )
    samples = headroom * max(int(f.shape[0]) for f in site_features)
    return {
        "aggregation": "ckks",
        "ckks_gram_bound": samples * norm * norm,
        "ckks_vector_bound": 2.0 * norm,
    }


def _cache(
    root: Path,
    name: str,
    feats: NDArray[Any],
    labels: NDArray[Any],
    patients: Sequence[str] | None = None,
    **meta: Any,
) -> None:
    cache_meta = CacheMeta(
        n=int(feats.shape[0]),
        d=int(feats.shape[1]),
        classes=tuple(meta.pop("classes")),
        source=str(meta.pop("source")),
        surrogate=bool(meta.pop("surrogate", False)),
        extra={"site": name, **meta},
    )
    ids = [f"{name}-{i}" for i in range(feats.shape[0])]
    write_cache(
        root / name, meta=cache_meta, ids=ids, labels=labels, features=feats, patients=patients
    )


def provision_distributed(
    root: str | os.PathLike[str],
    *,
    sites: Sequence[str],
    port: int,
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    decryptor: str | None = None,
    allow_plaintext: bool = False,
) -> ProvisionedFederation:
    """The production path of docs/operations.md §2, each party in its own folder under ``root``:
    ``operator/ca`` (``afl ca init``, CA key encrypted with a random passphrase), ``operator/inbox``
    (the request files the operator received, all it signs from), ``server``
    (``afl ca server-init``, then the signed ``operator/signed/server`` copied in), ``sites/<id>``
    (``afl-client init``, then ``afl-client init --import`` of ``operator/signed/sites/<id>``
    against the roster fingerprint, then site IT replaces the production [policy] the import
    wrote (DP required) by the development one :func:`provision` writes: the protections it
    accepts and the decryptor it pins, no DP budget). Returns the layout as a :class:`ProvisionedFederation`."""
    base = Path(root)
    passphrase = secrets.token_hex(16).encode()
    ca_dir, federation_id = init_ca(base / "operator" / "ca", passphrase=passphrase)
    server_kit = base / "server"
    requests = [init_server_kit(server_kit, hosts=["localhost"], port=port)[0]]
    site_dirs = {site: base / "sites" / site for site in sites}
    for site, kit in site_dirs.items():
        role = "decryptor" if site == decryptor else "participant"
        requests.append(init_site_kit(kit, site_id=site, role=role)[0])
    inbox = base / "operator" / "inbox"  # the operator receives the public request files only
    inbox.mkdir(parents=True)
    received = [Path(shutil.copyfile(path, inbox / path.name)) for path in requests]
    signed = sign_requests(
        ca_dir,
        received,
        base / "operator" / "signed",
        passphrase=passphrase,
        round_settings=round_settings,
    )
    for path in signed.server_dir.iterdir():  # the operator installs the coordinator's kit
        shutil.copyfile(path, server_kit / path.name)
    policy = site_policy(
        decryptor=decryptor,
        allow_plaintext=allow_plaintext,
        gram_scope=round_template(round_settings)["gram_scope"],
    )
    for site, kit in site_dirs.items():  # each site checks and installs its bundle
        import_bundle(kit, signed.site_dirs[site], roster_fingerprint=signed.roster.fingerprint)
        config = kit / "client.toml"
        doc = tomllib.loads(config.read_text(encoding="utf-8"))
        # The demo's runs have no DP: site IT replaces the production [policy] the import wrote
        # (DP required) by the development one, and says so (profile).
        doc["policy"] = {"profile": "development", **policy}
        config.write_text(toml_text.dumps(doc), encoding="utf-8")
    return ProvisionedFederation(
        root=base,
        federation_id=federation_id,
        server_address=signed.roster.server_address,
        ca_cert=ca_dir / "ca.pem",
        server_dir=server_kit,
        site_dirs=site_dirs,
    )


def prepare_loopback(
    root: str | os.PathLike[str],
    *,
    classes: Sequence[str],
    site_features: Sequence[NDArray[Any]],
    site_labels: Sequence[NDArray[Any]],
    active: NDArray[np.bool_],
    test_features: NDArray[Any],
    test_labels: NDArray[Any],
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    policy: Mapping[str, Mapping[str, toml_text.TomlValue]] | None = None,
    source: str = "surrogate",
    surrogate: bool = True,
    decryptor: bool = False,
    server_tables: Mapping[str, Mapping[str, toml_text.TomlValue]] | None = None,
    client_settings: Mapping[str, toml_text.TomlValue] | None = None,
    production: bool = False,
    allow_plaintext: bool = False,
    site_patients: Sequence[Sequence[str]] | None = None,
) -> LoopbackFederation:
    """Provision kits for ``len(site_features)`` sites and write their caches and configs.

    ``active[k, c]``: site k labels class c (its other labels become -1). ``round_settings``
    overrides server.toml's [round] (classes and feature_dim are filled in); ``server_tables``
    adds or updates other tables of server.toml (e.g. [retention]); ``client_settings`` updates
    [client] of every kit (e.g. ``serve = true``); ``policy`` maps a site id to [policy] overrides
    for its client.toml. ``production``: kits from :func:`provision_distributed` instead of the
    all-in-one :func:`provision`. The kits refuse ``plaintext`` plans unless ``allow_plaintext``
    opts every site in (:func:`afl.ops.provisioning.provision`). ``site_patients`` gives each
    site's per-row patient ids (the DP privacy unit; default: none in the caches).
    """
    out = Path(root)
    k = len(site_features)
    active = np.asarray(active, dtype=bool)
    if active.shape != (k, len(classes)):
        raise ValueError(f"active must be ({k}, {len(classes)}), got {active.shape}")
    site_ids = tuple(f"site-{i + 1}" for i in range(k))
    d = int(test_features.shape[1])
    settings: dict[str, toml_text.TomlValue] = {
        "classes": list(classes),
        "feature_dim": d,
        "min_participants": min(3, k),
        "enrol_timeout_s": 120.0,
        "upload_timeout_s": 300.0,
        **(round_settings or {}),
    }
    extra = ("decryptor",) if decryptor else ()  # CKKS: a dedicated decryptor site, no data
    make_kits = provision_distributed if production else provision
    fed = make_kits(
        out / "federation",
        sites=site_ids + extra,
        port=free_port(),
        round_settings=settings,
        decryptor=extra[0] if extra else None,
        allow_plaintext=allow_plaintext,
    )
    if server_tables:
        server_toml = fed.server_dir / "server.toml"
        doc = tomllib.loads(server_toml.read_text(encoding="utf-8"))
        for name, table in server_tables.items():
            doc[name] = {**doc.get(name, {}), **table}
        server_toml.write_text(toml_text.dumps(doc), encoding="utf-8")
    decryptor_config = None
    if decryptor:
        decryptor_config = fed.site_dirs["decryptor"] / "client.toml"
        doc = tomllib.loads(decryptor_config.read_text(encoding="utf-8"))
        doc["client"] = {**doc["client"], **DEMO_CLIENT_TIMING, **(client_settings or {})}
        decryptor_config.write_text(toml_text.dumps(doc), encoding="utf-8")
    data = out / "data"
    meta = {"classes": classes, "source": source, "surrogate": surrogate}
    configs = {}
    for i, site in enumerate(site_ids):
        labels = np.where(active[i], np.asarray(site_labels[i]), -1).astype(np.int8)
        patients = None if site_patients is None else site_patients[i]
        _cache(data, site, site_features[i], labels, patients, **meta)
        path = fed.site_dirs[site] / "client.toml"
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
        doc["data"] = {
            "cache": str((data / site).resolve()),
            "classes": [c for c, on in zip(classes, active[i], strict=True) if on],
        }
        doc["policy"] = {**doc.get("policy", {}), **(policy or {}).get(site, {})}
        doc["client"] = {**doc["client"], **DEMO_CLIENT_TIMING, **(client_settings or {})}
        path.write_text(toml_text.dumps(doc), encoding="utf-8")
        configs[site] = path
    _cache(data, "test", test_features, np.asarray(test_labels, dtype=np.int8), None, **meta)
    return LoopbackFederation(
        root=out,
        provisioned=fed,
        site_ids=site_ids,
        classes=tuple(classes),
        server_config=fed.server_dir / "server.toml",
        client_configs=configs,
        test_cache=data / "test",
        decryptor_config=decryptor_config,
    )


def prepare_labelled_everywhere(
    root: str | os.PathLike[str],
    *,
    classes: Sequence[str],
    site_features: Sequence[NDArray[Any]],
    site_labels: Sequence[NDArray[Any]],
    test_rows: int,
    **kw: Any,
) -> LoopbackFederation:
    """:func:`prepare_loopback` for sites that each label every class, tested on the first
    ``test_rows`` rows of the first site (the benches' and e2e tests' federation)."""
    return prepare_loopback(
        root,
        classes=classes,
        site_features=site_features,
        site_labels=site_labels,
        active=np.ones((len(site_features), len(classes)), dtype=bool),
        test_features=site_features[0][:test_rows],
        test_labels=site_labels[0][:test_rows],
        **kw,
    )


def _reports(state_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted((state_dir / "reports").glob("*.json")):
        report: dict[str, Any] = json.loads(p.read_text(encoding="utf-8"))
        report["_mtime"] = p.stat().st_mtime_ns
        out[p.stem] = report
    return out


def _host_codes(summary: Path | None) -> dict[str, int]:
    """{site: exit code} a run-many host wrote (empty when it wrote nothing)."""
    if summary is None or not summary.is_file():
        return {}
    codes: dict[str, int] = json.loads(summary.read_text(encoding="utf-8"))
    return codes


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


#: How :func:`run_loopback` starts a site daemon (followed by ``run --config ...``).
CLIENT_COMMAND = (sys.executable, "-m", "afl.client.cli")
#: How :func:`run_loopback` starts the coordinator (followed by ``--config ...``).
SERVER_COMMAND = (sys.executable, "-m", "afl.server.daemon.main")


def _site_groups(
    fed: LoopbackFederation, sites_per_process: int, alone: Mapping[str, Sequence[str]]
) -> list[tuple[str, ...]]:
    """Sites in launch order: one per process for a custom command, else groups of
    ``sites_per_process`` (hosted by ``afl-client run-many`` when more than one)."""
    hosted = [s for s in fed.client_configs if s not in alone]
    size = max(1, sites_per_process)
    groups = [tuple(hosted[i : i + size]) for i in range(0, len(hosted), size)]
    return groups + [(s,) for s in fed.client_configs if s in alone]


def run_loopback(
    fed: LoopbackFederation,
    *,
    timeout_s: float = 600.0,
    client_args: Sequence[str] = (),
    server_args: Sequence[str] = (),
    log_level: str = "WARNING",
    client_commands: Mapping[str, Sequence[str]] | None = None,
    server_command: Sequence[str] | None = None,
    host_command: Sequence[str] | None = None,
    sites_per_process: int = 1,
    on_started: Callable[[Mapping[str, int]], None] | None = None,
    on_wait: Callable[[], None] | None = None,
    standing_s: float = 0.0,
) -> LoopbackRun:
    """Start ``afl-server`` and every ``afl-client run`` as subprocesses, wait for the clients,
    stop the server; logs go to ``<root>/logs``. ``client_commands`` replaces, per site, the
    program that runs the client (``python -m afl.client.cli``) by another argv prefix that takes
    the same arguments (the drop-out tests start a client that vanishes mid-round);
    ``server_command`` likewise replaces ``python -m afl.server.daemon.main`` (the adversarial tests
    start a coordinator patched at run time). ``sites_per_process`` > 1 hosts that many sites per
    ``afl-client run-many`` process (sites with a custom command still run alone), started by
    ``host_command`` (default ``python -m afl.client.cli``) when given; a site's exit
    code is then the one its host reports. ``on_started`` gets the process ids ("server", and
    each client process by its first site, and "decryptor") once everything is started (memory
    sampling); ``on_wait`` is called about once a second while the clients run (progress).
    ``standing_s`` > 0 starts the last client process that long after the others, which enrol
    and wait meanwhile, as a deployment's daemons stand between runs (the round starts when the
    last one enrols)."""
    logs_dir = fed.root / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs: dict[str, Path] = {"server": logs_dir / "server.log"}
    start = time.perf_counter()
    server_cmd = [*(server_command or SERVER_COMMAND), "--config", str(fed.server_config)]
    server_cmd += ["--log-level", log_level, *server_args]
    handles = [open(logs["server"], "wb")]  # noqa: SIM115 (closed below)
    server = subprocess.Popen(server_cmd, stdout=handles[0], stderr=subprocess.STDOUT, env=env)
    clients: dict[str, subprocess.Popen[bytes]] = {}
    helpers: list[subprocess.Popen[bytes]] = []  # the CKKS decryptor: runs until stopped
    try:
        if fed.decryptor_config is not None:
            # A standing service in a deployment: started once the coordinator listens, it has
            # published its context before the round opens (started earlier, its first connection
            # is refused and its back-off can hold the sites' uploads back).
            await_listening(server, logs["server"], timeout_s=min(60.0, timeout_s))
            logs["decryptor"] = logs_dir / "decryptor.log"
            handles.append(open(logs["decryptor"], "wb"))  # noqa: SIM115
            cmd = [*CLIENT_COMMAND, "run", "--config", str(fed.decryptor_config)]
            cmd += ["--log-level", log_level, *client_args]
            helpers.append(
                subprocess.Popen(cmd, stdout=handles[-1], stderr=subprocess.STDOUT, env=env)
            )
        alone = client_commands or {}
        groups = _site_groups(fed, sites_per_process, alone)
        summaries: dict[str, Path] = {}
        for group in groups:
            first = group[0]
            if standing_s > 0 and group is groups[-1] and len(groups) > 1:
                time.sleep(standing_s)  # the others stand, enrolled (docstring)
            log_name = first if len(group) == 1 else f"host-{first}"
            logs[first] = logs_dir / f"{log_name}.log"
            handles.append(open(logs[first], "wb"))  # noqa: SIM115
            configs = [a for s in group for a in ("--config", str(fed.client_configs[s]))]
            if len(group) == 1:
                cmd = [*alone.get(first, CLIENT_COMMAND), "run", *configs]
            else:
                summaries[first] = logs_dir / f"host-{first}.json"
                cmd = [*(host_command or CLIENT_COMMAND), "run-many", *configs]
                cmd += ["--summary", str(summaries[first])]
            for s in group:
                logs[s] = logs[first]
            clients[first] = subprocess.Popen(
                [*cmd, "--log-level", log_level, *client_args],
                stdout=handles[-1],
                stderr=subprocess.STDOUT,
                env=env,
            )
        if on_started is not None:
            decryptor = {"decryptor": helpers[0].pid} if helpers else {}
            on_started(
                {"server": server.pid, **decryptor, **{s: p.pid for s, p in clients.items()}}
            )
        deadline = time.monotonic() + timeout_s
        next_wait = time.monotonic()
        ended: dict[str, int] = {}
        # Wait for every client; give up at the deadline or when the server dies first.
        while len(ended) < len(clients) and time.monotonic() < deadline:
            for first, proc in clients.items():
                if first not in ended and proc.poll() is not None:
                    ended[first] = proc.returncode
            if server.poll() is not None and len(ended) < len(clients):
                time.sleep(1.0)  # let clients that already finished write their reports
                break
            time.sleep(0.1)
            if on_wait is not None and time.monotonic() >= next_wait:
                on_wait()
                next_wait = time.monotonic() + 1.0
        rcs: dict[str, int] = {}
        for group in groups:
            proc = clients[group[0]]
            code = ended.get(group[0], proc.returncode if proc.poll() is not None else -1)
            hosted = _host_codes(summaries.get(group[0]))
            for s in group:
                rcs[s] = hosted.get(s, code if len(group) == 1 else -1)
    finally:
        for proc in [*clients.values(), *helpers]:
            _stop(proc)
        server_rc = _stop(server)
        for h in handles:
            h.close()
    wall = time.perf_counter() - start
    return LoopbackRun(server_rc, rcs, site_reports(fed), wall, logs)


#: What ``afl-server`` prints (to stderr) once it accepts connections.
LISTENING = "afl-server listening on port"


def await_listening(
    server: subprocess.Popen[bytes], log_path: Path, *, timeout_s: float, poll_s: float = 0.02
) -> bool:
    """Wait until ``server`` has written :data:`LISTENING` to ``log_path``; False (without
    waiting longer) when it exited first or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while server.poll() is None and time.monotonic() < deadline:
        if LISTENING.encode() in log_path.read_bytes():
            return True
        time.sleep(poll_s)
    return False


def site_reports(fed: LoopbackFederation) -> dict[str, dict[str, dict[str, Any]]]:
    """Every site's local round reports (site -> round id -> report), from its state folder."""
    return {
        site: _reports(
            fed.client_configs[site].parent
            / tomllib.loads(fed.client_configs[site].read_text())["client"]["state_dir"]
        )
        for site in fed.site_ids
    }
