"""`afl bench secagg`: in-process cost of secure aggregation (docs/protocol.md §4.2).

One round of the Bonawitz protocol (:func:`afl.crypto.secagg.local.run_local_round`) over K
simulated sites, each releasing the packed upper triangle of a d×d Gram matrix (d(d+1)/2 values,
524,800 for d = 1024) and the class vectors b (d·C values), against a plaintext sum of the same
float64 vectors (clients serialize, the server parses and adds). Reported per configuration:

    client_seconds_mean / _max   CPU-bound time of one site's calls (all stages)
    server_seconds               the server's time (verification, routing, unmasking, decoding)
    round_seconds_parallel       server_seconds + client_seconds_max: a round with sites working
                                 in parallel and free transport (no network cost modelled)
    bytes_up_per_site / bytes_down_per_site   canonical message bytes per site
    *_ratio                      masked / plaintext

and the max relative error of the decoded sums against the plaintext float64 sums. Input data
come from numpy's RNG (benchmark data, not secrets); masks use the protocol's CSPRNG/AES-CTR.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig
from afl.crypto.secagg.local import run_local_round
from afl.crypto.secagg.messages import Stage
from afl.lab.bench.common import (
    add_e2e_repeats_argument,
    add_standing_argument,
    emit_json,
    repetition_ratios,
)

__all__ = ["add_arguments", "run", "run_secagg_bench"]

GRAM_BOUND = 1e6
B_BOUND = 1e3


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(np.median([r[key] for r in runs])) for key in runs[0]}


def _plaintext_round(inputs: dict[str, dict[str, NDArray[np.float64]]]) -> dict[str, Any]:
    """Baseline: each site serializes its float64 vectors; the server parses and sums them."""
    client_times: list[float] = []
    payloads: dict[str, dict[str, bytes]] = {}
    for site, vectors in inputs.items():
        start = time.perf_counter()
        payloads[site] = {
            name: np.ascontiguousarray(v, dtype="<f8").tobytes() for name, v in vectors.items()
        }
        client_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    sums: dict[str, NDArray[np.float64]] = {}
    for payload in payloads.values():
        for name, raw in payload.items():
            v = np.frombuffer(raw, dtype="<f8")
            if name in sums:
                sums[name] += v
            else:
                sums[name] = v.astype(np.float64, copy=True)
    server = time.perf_counter() - start
    bytes_up = [sum(len(b) for b in p.values()) for p in payloads.values()]
    return {
        "client_seconds_mean": float(np.mean(client_times)),
        "client_seconds_max": float(np.max(client_times)),
        "server_seconds": server,
        "round_seconds_parallel": server + float(np.max(client_times)),
        "bytes_up_per_site": float(np.mean(bytes_up)),
        "bytes_down_per_site": 0.0,
        "sums": sums,
    }


def run_secagg_bench(
    *,
    num_sites: int,
    d: int,
    classes: int = 8,
    dropouts: int = 0,
    threshold: int | None = None,
    seed: int = 0,
    repeats: int = 1,
) -> dict[str, Any]:
    """Time one masked round and one plaintext sum for K = ``num_sites`` sites and dimension d.

    ``dropouts`` sites vanish after ShareKeys (their masks are recovered at Unmask). Each figure
    is the median over ``repeats`` rounds. Returns a JSON-ready dict (module docstring).
    """
    if num_sites < 2 or d < 1 or classes < 1 or dropouts < 0 or repeats < 1:
        raise ValueError("need num_sites >= 2, d >= 1, classes >= 1, dropouts >= 0, repeats >= 1")
    ids = [f"site-{i:03d}" for i in range(num_sites)]
    gram_len, b_len = d * (d + 1) // 2, d * classes
    config = RoundConfig.create(
        round_id="bench-round",
        cohort=ids,
        releases=[
            ReleaseSpec("gram", tuple(ids), gram_len, GRAM_BOUND),
            ReleaseSpec("b", tuple(ids), b_len, B_BOUND),
        ],
        threshold=threshold,
    )
    rng = np.random.default_rng(seed)
    inputs = {
        s: {
            "gram": rng.uniform(-GRAM_BOUND / 2, GRAM_BOUND / 2, gram_len),
            "b": rng.uniform(-B_BOUND / 2, B_BOUND / 2, b_len),
        }
        for s in ids
    }
    keys = {s: generate_identity_key() for s in ids}
    drops = {s: Stage.MASKED_INPUT for s in ids[:dropouts]}
    masked_runs: list[dict[str, float]] = []
    plain_runs: list[dict[str, float]] = []
    rel_err = 0.0
    for _ in range(repeats):
        report = run_local_round(
            config=config, identity_keys=keys, inputs=inputs, drop_before=drops
        )
        survivors = list(report.result.survivors)
        plain = _plaintext_round({s: inputs[s] for s in survivors})
        plain_sums = plain.pop("sums")
        plain_runs.append(plain)
        for n in ("gram", "b"):
            err = np.max(np.abs(report.result.sums[n] - plain_sums[n]))
            rel_err = max(rel_err, float(err / np.max(np.abs(plain_sums[n]))))
        client = [report.client_seconds[s] for s in survivors]
        masked_runs.append(
            {
                "client_seconds_mean": float(np.mean(client)),
                "client_seconds_max": float(np.max(client)),
                "server_seconds": report.server_seconds,
                "round_seconds_parallel": report.server_seconds + float(np.max(client)),
                "bytes_up_per_site": float(np.mean([report.bytes_up[s] for s in survivors])),
                "bytes_down_per_site": float(np.mean([report.bytes_down[s] for s in survivors])),
            }
        )
    masked, plain = _median(masked_runs), _median(plain_runs)
    ratios = {
        f"{key}_ratio": masked[key] / plain[key] if plain[key] > 0 else math.inf
        for key in (
            "client_seconds_mean",
            "server_seconds",
            "round_seconds_parallel",
            "bytes_up_per_site",
        )
    }
    return {
        "num_sites": num_sites,
        "d": d,
        "classes": classes,
        "values_per_site": gram_len + b_len,
        "threshold": config.t,
        "dropouts": dropouts,
        "repeats": repeats,
        "masked": masked,
        "plaintext": plain,
        **ratios,
        "max_relative_error": rel_err,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `afl bench secagg`."""
    parser.add_argument(
        "--sites", type=int, nargs="+", default=[8, 16, 32, 64], help="K values (default 8..64)"
    )
    parser.add_argument("--dim", type=int, nargs="+", default=[1024], help="feature dims d")
    parser.add_argument("--classes", type=int, default=8, help="b vectors per site (default 8)")
    parser.add_argument("--dropouts", type=int, default=0, help="sites vanishing after ShareKeys")
    parser.add_argument("--threshold", type=int, default=None, help="t (default ⌊K/2⌋+1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per point (median)")
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="instead: masked vs plaintext rounds through the real daemons on loopback mTLS "
        "(first --sites and --dim; afl.lab.bench.daemons.e2e)",
    )
    add_standing_argument(parser)
    add_e2e_repeats_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the grid sites × dim (or, with --e2e, the loopback daemons) and write JSON."""
    if args.e2e:
        from afl.lab.bench.daemons.e2e import memory_summary, run_e2e_bench

        row = run_e2e_bench(
            num_sites=args.sites[0],
            d=args.dim[0],
            seed=args.seed,
            modes=("plaintext", "mask"),
            standing_s=args.standing_s,
            repeats=args.e2e_repeats,
        )
        print(
            f"e2e K={row['num_sites']} d={row['d']}: round x{row['mask_round_seconds_ratio']:.2f}"
            f"{repetition_ratios(row, 'mask')}, "
            f"bytes/site x{row['mask_bytes_sent_per_site_ratio']:.2f}, all processes' CPU "
            f"x{row['mask_cpu_seconds_ratio']:.2f}; {memory_summary(row)}",
            file=sys.stderr,
        )
        emit_json({"benchmark": "secagg-e2e", "results": [row]}, args.out)
        return 0
    results = []
    for d in args.dim:
        for k in args.sites:
            row = run_secagg_bench(
                num_sites=k,
                d=d,
                classes=args.classes,
                dropouts=args.dropouts,
                threshold=args.threshold,
                seed=args.seed,
            )
            results.append(row)
            print(
                f"K={k:3d} d={d:5d}: round x{row['round_seconds_parallel_ratio']:.1f}, client "
                f"{row['masked']['client_seconds_mean']:.3f}s, server "
                f"{row['masked']['server_seconds']:.3f}s, bytes/site x"
                f"{row['bytes_up_per_site_ratio']:.2f}",
                file=sys.stderr,
            )
    emit_json({"benchmark": "secagg", "results": results}, args.out)
    return 0
