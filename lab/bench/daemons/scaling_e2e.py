"""`afl bench scaling --e2e`: masked rounds through the real daemons for K = 8 … 256 sites, with
the full and the sparse masking graph (docs/benchmarks.md §3c).

Per (graph, K): one loopback federation (:func:`afl.lab.demo.federation.prepare_loopback`:
provisioned kits, K random caches of ``rows`` × d float32 features, 8 classes), ``afl-server``
and the K sites hosted by ``hosts`` ``afl-client run-many`` processes (each site with its own kit
and mutual-TLS channel), ``aggregation = "mask"`` with the operator's bounds and
``mask_graph = "full"`` or ``"sparse"`` (default colluder and drop-out fractions). Reported:

    round_seconds             the slowest site's round (plan check -> verified model)
    exchange_seconds          the slowest site's masked exchange (all five stages)
    wall_seconds              the whole run, process start-up and enrolment included
    bytes_sent_per_site       mean bytes a site sent (masked uploads and MASK messages)
    server_peak_rss_mib       afl-server's peak resident memory
    site_rss_mib_per_site     the hosts' summed peak resident memory / K
    degree, share_threshold   the plan's graph (k = K - 1, t for the full graph)
    w_relative_error          ‖W - W_plain‖/‖W_plain‖ against the plaintext W of the same data
                              computed in process (summed local statistics, a scipy solve)

and, per graph and figure, the growth exponent b of y ≈ a·K^b (least squares in log-log).
A masked W further than 1e-9 (relative) from the plaintext W fails the bench (exit 1).
Memory is read from /proc (Linux); elsewhere it is reported as null.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg
from numpy.typing import NDArray

from afl.core.stats import local_statistics
from afl.lab.bench.common import describe_machine
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    mask_round_settings,
    prepare_labelled_everywhere,
    run_loopback,
)

__all__ = [
    "GRAPHS",
    "W_TOLERANCE",
    "growth_exponent",
    "random_sites",
    "run_scaling_e2e",
    "scaling_e2e_point",
]

GRAPHS = ("full", "sparse")
CLASSES = ("A", "B", "C", "D", "E", "F", "G", "H")
W_TOLERANCE = 1e-9
#: Client timing for many sites: stage waits follow the round-event stream; the safety-net poll
#: every 2 s keeps K = 256 sites from flooding the coordinator with status calls.
CLIENT_TIMING = {"poll_interval_s": 0.2, "max_poll_interval_s": 2.0, "max_wait_s": 3600.0}
FIGURES = ("round_seconds", "exchange_seconds", "wall_seconds", "bytes_sent_per_site")


class PeakMemory:
    """Peak resident memory (MiB) of processes: the kernel's high-water mark VmHWM (the true
    peak, not a sample), read every ``interval_s`` while each process lives; and their CPU
    seconds (user + system, /proc/PID/stat) as last read (up to ``interval_s`` before exit)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afl-bench-rss", daemon=True)

    def watch(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self._pids.items():
                rss = rss_mib(pid)
                if rss is not None:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), rss)
                cpu = cpu_seconds(pid)
                if cpu is not None:
                    self.cpu[name] = cpu
            self._stop.wait(self.interval_s)


def rss_mib(pid: int) -> float | None:
    """The peak resident memory of ``pid`` so far in MiB: VmHWM (VmRSS where the kernel does not
    report it); None when the process is gone or /proc is missing."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    for name in ("VmHWM", "VmRSS"):
        if name in fields:
            return int(fields[name].split()[0]) / 1024.0
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (/proc/PID/stat); None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def growth_exponent(ks: Sequence[int], values: Sequence[float]) -> float | None:
    """b of values ≈ a·K^b by least squares on (log K, log value); None with < 2 points."""
    pairs = [(math.log(k), math.log(v)) for k, v in zip(ks, values, strict=True) if v > 0]
    if len(pairs) < 2:
        return None
    x, y = np.array(pairs).T
    slope = np.polyfit(x, y, 1)[0]
    return float(slope)


def random_sites(
    k: int, *, d: int, rows: int, seed: int
) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]]]:
    """K sites' benchmark caches: ``rows`` × d standard-normal float32 features and 0/1 labels
    of the 8 :data:`CLASSES` (numpy's RNG from ``seed``: data, not secrets)."""
    rng = np.random.default_rng(seed)
    feats = [rng.normal(size=(rows, d)).astype(np.float32) for _ in range(k)]
    labels = [(rng.random((rows, len(CLASSES))) < 0.3).astype(np.int8) for _ in range(k)]
    return feats, labels


def plaintext_weights(
    feats: Sequence[NDArray[np.float32]], labels: Sequence[NDArray[np.int8]], *, gamma: float = 1.0
) -> NDArray[np.float64]:
    """The oracle: W = (Σ_k G_k + γI)⁻¹ Σ_k B_k in float64 (global scope, every site labels
    every class), from each site's local statistics, summed as they are computed."""
    d, classes = feats[0].shape[1], labels[0].shape[1]
    gram = np.zeros((d, d))
    b = np.zeros((d, classes))
    for h, y in zip(feats, labels, strict=True):
        stats = local_statistics(h, y, active=np.ones(classes, dtype=bool))
        gram += stats.gram
        b += stats.b
    gram[np.diag_indices(d)] += gamma
    return np.asarray(scipy.linalg.solve(gram, b, assume_a="pos"), dtype=np.float64)


def _figures(
    run: LoopbackRun, loop: LoopbackFederation, memory: PeakMemory, *, k: int
) -> dict[str, Any]:
    finals = [run.final_report(s) for s in loop.site_ids]
    failed = [(s, r.get("reason")) for s, r in zip(loop.site_ids, finals, strict=True)]
    if any(r.get("outcome") != "COMPLETED" for r in finals):
        raise RuntimeError(f"the federation failed: {failed[:3]} (logs: {loop.root / 'logs'})")
    graph = finals[0]["plan"].get("mask_graph", {})
    hosts = [v for name, v in memory.peaks.items() if name not in ("server", "decryptor")]
    return {
        "round_seconds": max(r["timings_s"]["round"] for r in finals),
        "exchange_seconds": max(r["timings_s"]["upload"] for r in finals),
        "wall_seconds": run.wall_s,
        "bytes_sent_per_site": float(np.mean([r["bytes_sent"] for r in finals])),
        "bytes_received_per_site": float(np.mean([r["bytes_received"] for r in finals])),
        "server_peak_rss_mib": memory.peaks.get("server"),
        "site_rss_mib_per_site": sum(hosts) / k if hosts else None,
        "host_processes": len(hosts),
        "degree": int(graph.get("degree", k - 1)),
        "share_threshold": graph.get("share_threshold"),
        "colluders": graph.get("colluders"),
        "dropouts": graph.get("dropouts"),
        "failure_log2": graph.get("failure_log2"),
        "weights": np.load(finals[0]["model"]["path"]),
    }


def masked_federation(
    root: Path,
    feats: Sequence[NDArray[Any]],
    labels: Sequence[NDArray[Any]],
    *,
    graph: str,
    timeout_s: float,
    client_settings: dict[str, Any] | None,
) -> LoopbackFederation:
    """The benches' masked federation over these caches: a global Gram, the ``graph`` masking
    graph, every stage's deadline ``timeout_s``, the operator's declared bounds."""
    settings: dict[str, Any] = {
        **mask_round_settings(feats),
        "gram_scope": "global",
        "mask_graph": graph,
        "enrol_timeout_s": timeout_s,
        "upload_timeout_s": timeout_s,
    }
    return prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=10,
        round_settings=settings,
        client_settings=client_settings,
    )


def scaling_e2e_point(
    root: Path,
    *,
    k: int,
    graph: str,
    d: int,
    rows: int,
    hosts: int,
    seed: int,
    timeout_s: float,
    reference: NDArray[np.float64] | None = None,
    standing_s: float = 0.0,
) -> dict[str, Any]:
    """One masked round over K sites with the given graph; the figures of the module docstring.
    ``standing_s``: the sites of every host process but the last stand that long, enrolled,
    before it starts (:func:`afl.lab.demo.federation.run_loopback`)."""
    feats, labels = random_sites(k, d=d, rows=rows, seed=seed)
    loop = masked_federation(
        root, feats, labels, graph=graph, timeout_s=timeout_s, client_settings=CLIENT_TIMING
    )
    memory = PeakMemory()
    try:
        run = run_loopback(
            loop,
            timeout_s=timeout_s,
            sites_per_process=math.ceil(k / max(1, hosts)),
            on_started=memory.watch,
            standing_s=standing_s,
        )
    finally:
        memory.stop()
    out = _figures(run, loop, memory, k=k)
    w = out.pop("weights")
    w_plain = plaintext_weights(feats, labels) if reference is None else reference
    out["w_relative_error"] = float(np.linalg.norm(w - w_plain) / np.linalg.norm(w_plain))
    return {"num_sites": k, "graph": graph, **out}


def run_scaling_e2e(
    *,
    sites: Sequence[int] = (8, 16, 32, 64, 128, 256),
    graphs: Sequence[str] = GRAPHS,
    d: int = 1024,
    rows: int = 300,
    hosts: int = 4,
    full_max_sites: int = 256,
    seed: int = 0,
    timeout_s: float = 1800.0,
    work_dir: str | None = None,
    keep: bool = False,
    standing_s: float = 0.0,
) -> dict[str, Any]:
    """The sweep over ``sites`` × ``graphs`` (the full graph up to ``full_max_sites``);
    ``keep``: leave the federations (kits, logs, reports, server state) in ``work_dir``."""
    if not sites or set(graphs) - set(GRAPHS) or min(sites) < 4:
        raise ValueError(f"need K values >= 4 and graphs from {GRAPHS}")
    rows_out: list[dict[str, Any]] = []
    prefix = "afl-bench-scaling-"
    folder: contextlib.AbstractContextManager[str] = (
        contextlib.nullcontext(tempfile.mkdtemp(prefix=prefix, dir=work_dir))
        if keep
        else tempfile.TemporaryDirectory(prefix=prefix, dir=work_dir)
    )
    with folder as tmp:
        for k in sites:
            feats, labels = random_sites(k, d=d, rows=rows, seed=seed)
            reference = plaintext_weights(feats, labels)
            del feats, labels
            for graph in graphs:
                if graph == "full" and k > full_max_sites:
                    continue
                start = time.perf_counter()
                row = scaling_e2e_point(
                    Path(tmp) / f"{graph}-{k}",
                    k=k,
                    graph=graph,
                    d=d,
                    rows=rows,
                    hosts=hosts,
                    seed=seed,
                    timeout_s=timeout_s,
                    reference=reference,
                    standing_s=standing_s,
                )
                row["bench_seconds"] = time.perf_counter() - start
                rows_out.append(row)
    exponents: dict[str, dict[str, float | None]] = {}
    for graph in graphs:
        mine = [r for r in rows_out if r["graph"] == graph]
        ks = [r["num_sites"] for r in mine]
        figures = (*FIGURES, "server_peak_rss_mib", "site_rss_mib_per_site")
        exponents[graph] = {
            f: growth_exponent(ks, [float(r[f] or 0.0) for r in mine]) for f in figures
        }
    return {
        "suite": "scaling-e2e",
        "machine": describe_machine(),
        "d": d,
        "rows_per_site": rows,
        "classes": len(CLASSES),
        "hosts": hosts,
        "seed": seed,
        "standing_s": standing_s,
        "w_tolerance": W_TOLERANCE,
        "points": rows_out,
        "growth_exponents": exponents,
        "w_matches_plaintext": all(r["w_relative_error"] <= W_TOLERANCE for r in rows_out),
    }
