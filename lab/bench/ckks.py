"""`afl bench ckks`: in-process cost and accuracy of the CKKS mode (docs/protocol.md §4.3).

K simulated sites each encrypt the packed upper triangle of a d×d Gram matrix (d(d+1)/2 values,
524,800 for d = 1024, 65 ciphertexts of two values a slot) and their class vectors b (d·C values) under the
decryptor's public context; the server deserializes the uploads, sums them homomorphically and
serializes the sums; the decryptor decrypts them with the tag check and the grid rounding
(:mod:`afl.crypto.ckks.scheme`, :mod:`afl.crypto.ckks.decrypt`). Reported (medians over ``repeats``):

    encrypt_seconds_mean / _max   one site's encryption + serialization (Gram and b)
    draw_ahead_seconds_mean       drawing that site's encryptions of zero ahead (while it
                                  waits for the round, afl.crypto.ckks.zeros)
    encrypt_drawn_ahead_seconds_mean  the encryption + serialization from them (the round's
                                  part); odd-numbered sites' uploads in the sums are these
    bytes_per_site                serialized ciphertext bytes one site uploads
    plaintext_bytes_per_site      the same vectors as float64 (8 bytes a value)
    server_seconds                deserialize + homomorphic sum + serialize (all blocks)
    server_sum_seconds            the additions alone
    decrypt_seconds               deserialize + decrypt + tag check + grid rounding (all blocks)
    round_seconds_parallel        encrypt_seconds_max + server_seconds + decrypt_seconds (sites in
                                  parallel, free transport), vs the plaintext round
                                  (serialize float64, parse and add)
    max_abs_error / max_rel_error per block, against the float64 sum (rel: / max |sum|), with
    the derived ``error_bound`` of afl.crypto.ckks.params for comparison.

Gram-like inputs: G_k = H_kᵀH_k for H_k with ``rows`` rows of |N(0, 10²)| entries (diagonal
~2.6e4 for 256 rows); b-like inputs: N(0, (1e-3)²). The declared bounds are the smallest powers
of two above the largest entries (times ``bound_slack``). Input data come from numpy's RNG
(benchmark data, not secrets); tags come from ``secrets`` as in the protocol.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import decrypt_release
from afl.crypto.ckks.zeros import ZeroPool
from afl.lab.bench.common import (
    add_e2e_repeats_argument,
    add_standing_argument,
    emit_json,
    repetition_ratios,
)

__all__ = ["add_arguments", "run", "run_ckks_bench"]


def _inputs(
    *, num_sites: int, d: int, classes: int, rows: int, seed: int
) -> list[dict[str, NDArray[np.float64]]]:
    rng = np.random.default_rng(seed)
    iu = np.triu_indices(d)
    out = []
    for _ in range(num_sites):
        h = np.abs(rng.normal(0.0, 10.0, size=(rows, d)))
        out.append({"gram": (h.T @ h)[iu], "b": rng.normal(0.0, 1e-3, size=d * classes)})
    return out


def _declared_bound(blocks: list[NDArray[np.float64]], slack: float) -> float:
    peak = max(float(np.max(np.abs(b))) for b in blocks) * slack
    return 2.0 ** math.ceil(math.log2(peak))


def _plaintext_round(inputs: list[dict[str, NDArray[np.float64]]]) -> dict[str, float]:
    client: list[float] = []
    payloads = []
    for site in inputs:
        start = time.perf_counter()
        payloads.append(
            {n: np.ascontiguousarray(v, dtype="<f8").tobytes() for n, v in site.items()}
        )
        client.append(time.perf_counter() - start)
    start = time.perf_counter()
    sums: dict[str, NDArray[np.float64]] = {}
    for payload in payloads:
        for name, raw in payload.items():
            v = np.frombuffer(raw, dtype="<f8")
            sums[name] = sums[name] + v if name in sums else v.copy()
    server = time.perf_counter() - start
    return {
        "client_seconds_max": max(client),
        "server_seconds": server,
        "round_seconds_parallel": max(client) + server,
        "bytes_per_site": float(np.mean([sum(len(b) for b in p.values()) for p in payloads])),
    }


def _ckks_round(
    private_ctx: Any,
    public_bytes: bytes,
    inputs: list[dict[str, NDArray[np.float64]]],
    spec: dict[str, tuple[float, float]],
) -> tuple[dict[str, float], dict[str, NDArray[np.float64]]]:
    """One round; ``spec`` maps block name -> (prescale, grid)."""
    k = len(inputs)
    client_ctx = ckks.load_public_context(public_bytes)
    enc_times: list[float] = []
    gram_times: list[float] = []
    uploads: list[dict[str, list[bytes]]] = []
    tags: dict[str, list[float]] = {name: [] for name in spec}
    draw_times: list[float] = []
    online_times: list[float] = []
    for index, site in enumerate(inputs):
        upload, drawn_upload = {}, {}
        site_seconds = 0.0
        for name, values in site.items():
            start = time.perf_counter()
            tag = ckks.new_tag(num_summands=k)
            tags[name].append(tag)
            upload[name] = ckks.encrypt_block_bytes(
                client_ctx, values, prescale=spec[name][0], num_summands=k, tag=tag
            )
            elapsed = time.perf_counter() - start
            site_seconds += elapsed
            if name == "gram":
                gram_times.append(elapsed)
        enc_times.append(site_seconds)
        # The same site with encryptions of zero drawn while it waited (afl.crypto.ckks.zeros).
        count = sum(cp.num_ciphertexts(v.size) for v in site.values())
        pool = ZeroPool(client_ctx, context_sha256=b"bench", capacity=count)
        start = time.perf_counter()
        pool.fill(count)
        draw_times.append(time.perf_counter() - start)
        take = functools.partial(pool.take, b"bench")
        start = time.perf_counter()
        for name, values in site.items():
            drawn_upload[name] = ckks.encrypt_block_bytes(
                client_ctx,
                values,
                prescale=spec[name][0],
                num_summands=k,
                tag=tags[name][-1],
                zeros=take,
            )
        online_times.append(time.perf_counter() - start)
        uploads.append(drawn_upload if index % 2 else upload)  # both kinds in every sum
    server_ctx = ckks.load_public_context(public_bytes)
    start = time.perf_counter()
    sum_seconds = 0.0
    summed: dict[str, list[bytes]] = {}
    for name in spec:
        length = inputs[0][name].size
        lists = [ckks.deserialize_ciphertexts(server_ctx, u[name], length=length) for u in uploads]
        t0 = time.perf_counter()
        total = ckks.sum_ciphertexts(server_ctx, lists, length=length)
        sum_seconds += time.perf_counter() - t0
        summed[name] = ckks.serialize_ciphertexts(total)
    server = time.perf_counter() - start
    start = time.perf_counter()
    results = {
        name: decrypt_release(
            private_ctx,
            summed[name],
            member_tags=tags[name],
            length=inputs[0][name].size,
            prescale=prescale,
            num_summands=k,
            grid=grid,
        )
        for name, (prescale, grid) in spec.items()
    }
    decrypt = time.perf_counter() - start
    timing = {
        "encrypt_seconds_mean": float(np.mean(enc_times)),
        "encrypt_seconds_max": max(enc_times),
        "server_seconds": server,
        "server_sum_seconds": sum_seconds,
        "decrypt_seconds": decrypt,
        "round_seconds_parallel": max(enc_times) + server + decrypt,
        "gram_encrypt_seconds_mean": float(np.mean(gram_times)),
        "draw_ahead_seconds_mean": float(np.mean(draw_times)),
        "encrypt_drawn_ahead_seconds_mean": float(np.mean(online_times)),
        "bytes_per_site": float(
            np.mean([sum(len(b) for v in u.values() for b in v) for u in uploads])
        ),
        "gram_bytes_per_site": float(np.mean([sum(len(b) for b in u["gram"]) for u in uploads])),
    }
    return timing, results


def run_ckks_bench(
    *,
    d: int,
    num_sites: int,
    classes: int = 8,
    rows: int = 256,
    bound_slack: float = 1.0,
    seed: int = 0,
    repeats: int = 1,
) -> dict[str, Any]:
    """Time ``repeats`` CKKS rounds and plaintext rounds for K = ``num_sites``, dimension d.

    Returns a JSON-ready dict (module docstring).
    """
    if num_sites < 1 or d < 1 or classes < 1 or rows < 1 or repeats < 1 or bound_slack < 1:
        raise ValueError("need num_sites, d, classes, rows, repeats >= 1 and bound_slack >= 1")
    inputs = _inputs(num_sites=num_sites, d=d, classes=classes, rows=rows, seed=seed)
    spec: dict[str, tuple[float, float]] = {}
    bounds: dict[str, float] = {}
    for name in ("gram", "b"):
        bounds[name] = _declared_bound([site[name] for site in inputs], bound_slack)
        s = cp.choose_prescale(bound=bounds[name], num_summands=num_sites)
        spec[name] = (s, cp.default_grid(prescale=s, num_summands=num_sites))
    start = time.perf_counter()
    private_ctx = ckks.create_private_context()
    public_bytes = ckks.public_context_bytes(private_ctx)
    context_seconds = time.perf_counter() - start
    ckks_runs, plain_runs = [], []
    results: dict[str, NDArray[np.float64]] = {}
    for _ in range(repeats):
        timing, results = _ckks_round(private_ctx, public_bytes, inputs, spec)
        ckks_runs.append(timing)
        plain_runs.append(_plaintext_round(inputs))
    med = {key: float(np.median([r[key] for r in ckks_runs])) for key in ckks_runs[0]}
    plain = {key: float(np.median([r[key] for r in plain_runs])) for key in plain_runs[0]}
    accuracy = {}
    for name, (prescale, grid) in spec.items():
        exact = np.sum([site[name] for site in inputs], axis=0)
        err = float(np.max(np.abs(results[name] - exact)))
        accuracy[name] = {
            "length": int(exact.size),
            "ciphertexts": cp.num_ciphertexts(int(exact.size)),
            "declared_bound": bounds[name],
            "max_abs_sum": float(np.max(np.abs(exact))),
            "prescale": prescale,
            "grid": grid,
            "max_abs_error": err,
            "max_rel_error": err / float(np.max(np.abs(exact))),
            "error_bound": cp.error_bound(prescale=prescale, num_summands=num_sites, grid=grid),
        }
    return {
        "num_sites": num_sites,
        "d": d,
        "classes": classes,
        "repeats": repeats,
        "params": {
            "poly_modulus_degree": cp.POLY_MODULUS_DEGREE,
            "coeff_mod_bit_sizes": list(cp.COEFF_MOD_BIT_SIZES),
            "scale_bits": cp.GLOBAL_SCALE_BITS,
            "security_bits": cp.SECURITY_LEVEL_BITS,
        },
        "context_seconds": context_seconds,
        "public_context_bytes": len(public_bytes),
        "ckks": med,
        "plaintext": plain,
        "plaintext_bytes_per_site": plain["bytes_per_site"],
        "bytes_ratio": med["bytes_per_site"] / plain["bytes_per_site"],
        "round_seconds_ratio": med["round_seconds_parallel"] / plain["round_seconds_parallel"],
        "accuracy": accuracy,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `afl bench ckks`."""
    parser.add_argument("--sites", type=int, nargs="+", default=[8], help="K values (default 8)")
    parser.add_argument("--dim", type=int, nargs="+", default=[1024], help="feature dims d")
    parser.add_argument("--classes", type=int, default=8, help="b vectors per site (default 8)")
    parser.add_argument("--rows", type=int, default=256, help="samples per site's Gram")
    parser.add_argument("--bound-slack", type=float, default=1.0, help="declared bound / max")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds per point (median)")
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="instead: CKKS vs plaintext (vs mask) rounds through the real daemons on loopback "
        "mTLS (first --sites and --dim; afl.lab.bench.daemons.e2e)",
    )
    parser.add_argument(
        "--no-mask", action="store_true", help="with --e2e: skip the MASK comparison"
    )
    add_standing_argument(parser)
    add_e2e_repeats_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the grid sites × dim (or, with --e2e, the loopback daemons) and write JSON."""
    if args.e2e:
        from afl.lab.bench.daemons.e2e import MODES, memory_summary, run_e2e_bench

        modes = [m for m in MODES if not (args.no_mask and m == "mask")]
        row = run_e2e_bench(
            num_sites=args.sites[0],
            d=args.dim[0],
            seed=args.seed,
            modes=modes,
            standing_s=args.standing_s,
            repeats=args.e2e_repeats,
        )
        print(
            f"e2e K={row['num_sites']} d={row['d']}: ckks round x{row['ckks_round_seconds_ratio']:.2f}"
            f"{repetition_ratios(row, 'ckks')}"
            f", bytes x{row['ckks_bytes_sent_per_site_ratio']:.2f}"
            f", all processes' CPU x{row['ckks_cpu_seconds_ratio']:.2f} vs plaintext"
            + (
                f"; mask round x{row['mask_round_seconds_ratio']:.2f}"
                f"{repetition_ratios(row, 'mask')}"
                if "mask" in row
                else ""
            )
            + "; "
            f"{memory_summary(row)}",
            file=sys.stderr,
        )
        emit_json({"benchmark": "ckks-e2e", "results": [row]}, args.out)
        return 0
    rows = []
    for d in args.dim:
        for k in args.sites:
            row = run_ckks_bench(
                d=d,
                num_sites=k,
                classes=args.classes,
                rows=args.rows,
                bound_slack=args.bound_slack,
                seed=args.seed,
                repeats=args.repeats,
            )
            rows.append(row)
            c = row["ckks"]
            print(
                f"K={k:3d} d={d:5d}: encrypt {c['encrypt_seconds_mean']:.3f}s/site "
                f"({c['encrypt_drawn_ahead_seconds_mean']:.3f}s with zeros drawn ahead in "
                f"{c['draw_ahead_seconds_mean']:.3f}s), "
                f"{c['bytes_per_site'] / 1e6:.1f} MB/site (x{row['bytes_ratio']:.1f}), server "
                f"{c['server_seconds']:.3f}s, decrypt {c['decrypt_seconds']:.3f}s, gram rel err "
                f"{row['accuracy']['gram']['max_rel_error']:.2e}",
                file=sys.stderr,
            )
    emit_json({"benchmark": "ckks", "results": rows}, args.out)
    return 0
