"""`afl bench flower`: one masked round three ways on the same K and vector length, each against
its own plaintext round, in one run (docs/benchmarks.md §8, docs/flower.md):

    afl-daemons   afl-server + K ``afl-client run`` processes over loopback mTLS
                  (:func:`afl.lab.demo.federation.run_loopback`): plaintext vs mask
    afl-flower    afl's Flower app on Flower's simulation engine (Ray), started from Python,
                  and optionally on others (``--engines``: ``simulation`` = ``flwr run`` against a
                  local SuperLink, ``deployment`` = one flower-supernode per site): plaintext
                  vs mask, on the same site caches as the daemons
    flower        Flower's own SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``) on the
                  simulation engine: a FedAvg round of K clients each sending the same number of
                  values as an afl site, plain vs SecAgg+ (complete graph: num_shares = K,
                  reconstruction threshold ⌊K/2⌋+1, as afl's full graph)

A site's values: the packed Gram d(d+1)/2 plus one class vector of d per class (532,992 at
d = 1024 and 8 classes). afl's round time is the slowest site's, plan check to verified model
(its report); Flower's is the server's fit round (the workflow's fit phase, configuration to
aggregate) of its second round (the first also starts the engine's Ray workers, which afl's
timed span — plan check on — does not include). Ratios are to each system's own plaintext round. Random benchmark features (numpy
RNG: data, not secrets). The JSON records the machine (:mod:`afl.lab.bench.common`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from afl.lab.bench.common import describe_machine, emit_json, format_machine
from afl.lab.bench.daemons.e2e import round_figures
from afl.lab.demo.federation import (
    mask_round_settings,
    prepare_labelled_everywhere,
    run_loopback,
)

__all__ = ["run_flower_bench", "secaggplus_round", "values_per_site"]

CLASSES = ("A", "B", "C", "D", "E", "F", "G", "H")
ENGINES = ("python", "simulation", "deployment")
#: Flower's rounds: the first also starts the simulation engine's workers, so the second is timed.
ROUNDS = 2


def values_per_site(d: int, classes: int) -> int:
    """Values one afl site contributes to a global-Gram round: d(d+1)/2 + classes·d."""
    return d * (d + 1) // 2 + classes * d


def secaggplus_round(
    *, num_sites: int, length: int, secure: bool, threshold: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """FedAvg fit rounds of Flower's own stack on its simulation engine: K clients each
    returning ``length`` float32 values, plain or through SecAgg+; the second round timed
    (module docstring)."""
    from flwr.app import Context
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    t = threshold or num_sites // 2 + 1
    timings: list[float] = []

    class _Client(NumPyClient):
        def __init__(self, partition: int) -> None:
            rng = np.random.default_rng(seed + partition)
            self.values = rng.uniform(-1.0, 1.0, length).astype(np.float32)

        def fit(self, parameters: Any, config: Any) -> tuple[list[Any], int, dict[str, Any]]:
            return [self.values], 1, {}

    def client_fn(context: Context) -> Any:
        return _Client(int(context.node_config["partition-id"])).to_client()

    def timed(inner: Callable[[Grid, Context], None]) -> Callable[[Grid, Context], None]:
        def fit(grid: Grid, context: Context) -> None:
            start = time.perf_counter()
            inner(grid, context)
            timings.append(time.perf_counter() - start)

        return fit

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=num_sites,
            min_available_clients=num_sites,
            initial_parameters=ndarrays_to_parameters([np.zeros(length, dtype=np.float32)]),
        )
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        if secure:
            fit = timed(SecAggPlusWorkflow(num_shares=num_sites, reconstruction_threshold=t))
        else:
            from flwr.server.workflow.default_workflows import default_fit_workflow

            fit = timed(default_fit_workflow)
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)

    client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])
    wall = time.perf_counter()
    run_simulation(
        server,
        client,
        num_supernodes=num_sites,
        backend_config={"client_resources": {"num_cpus": 1}},
    )
    if len(timings) != ROUNDS:
        raise RuntimeError(f"Flower ran {len(timings)} of {ROUNDS} fit rounds (see its log)")
    return {
        "round_seconds": timings[-1],
        "first_round_seconds": timings[0],
        "wall_seconds": time.perf_counter() - wall,
        **({"num_shares": num_sites, "reconstruction_threshold": t} if secure else {}),
    }


def _afl_round(
    root: Path,
    feats: Sequence[Any],
    labels: Sequence[Any],
    *,
    mode: str,
    engine: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    """One afl round on these caches: the daemons (``engine`` None) or the Flower app."""
    settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 600.0}
    settings.update(mask_round_settings(feats) if mode == "mask" else {"aggregation": mode})
    fed = prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=10,
        round_settings=settings,
        allow_plaintext=mode == "plaintext",  # the baseline: the sites opt in
    )
    if engine is None:
        run = run_loopback(fed, timeout_s=timeout_s)
    else:
        from afl.lab.demo.flower_federation import run_flower

        run = run_flower(fed, engine=engine, timeout_s=timeout_s)
    return round_figures(run, fed)


def _ratios(out: dict[str, Any], secure: str, plain: str) -> None:
    for key in ("round_seconds", "bytes_sent_per_site"):
        if key in out[secure] and key in out[plain]:
            out[f"{secure}_{key}_ratio"] = out[secure][key] / out[plain][key]


def run_flower_bench(
    *,
    num_sites: int,
    d: int = 1024,
    rows: int = 300,
    engines: Sequence[str] = ("python",),
    flower_secaggplus: bool = True,
    seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """The three systems at one K (module docstring)."""
    rng = np.random.default_rng(seed)
    feats = [rng.normal(size=(rows, d)).astype(np.float32) for _ in range(num_sites)]
    labels = [(rng.random((rows, len(CLASSES))) < 0.3).astype(np.int8) for _ in range(num_sites)]
    length = values_per_site(d, len(CLASSES))
    row: dict[str, Any] = {"num_sites": num_sites, "d": d, "values_per_site": length}
    weights: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="afl-bench-flower-") as tmp:
        for system, engine in [("afl-daemons", None), *((f"afl-flower-{e}", e) for e in engines)]:
            out: dict[str, Any] = {}
            for mode in ("plaintext", "mask"):
                where = Path(tmp) / system / mode
                out[mode] = _afl_round(
                    where, feats, labels, mode=mode, engine=engine, timeout_s=timeout_s
                )
                weights[f"{system}/{mode}"] = out[mode].pop("weights")
                print(
                    f"K={num_sites} {system} {mode}: {out[mode]['round_seconds']:.2f} s",
                    file=sys.stderr,
                )
            _ratios(out, "mask", "plaintext")
            row[system] = out
    if flower_secaggplus:
        out = {
            "plain": secaggplus_round(num_sites=num_sites, length=length, secure=False, seed=seed),
            "secaggplus": secaggplus_round(
                num_sites=num_sites, length=length, secure=True, seed=seed
            ),
        }
        _ratios(out, "secaggplus", "plain")
        print(
            f"K={num_sites} flower secagg+: {out['secaggplus']['round_seconds']:.2f} s",
            file=sys.stderr,
        )
        row["flower"] = out
    reference = weights["afl-daemons/plaintext"]
    row["w_relative_difference"] = {
        name: float(np.linalg.norm(w - reference) / np.linalg.norm(reference))
        for name, w in weights.items()
        if name != "afl-daemons/plaintext"
    }
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `afl bench flower`."""
    parser.add_argument("--sites", type=int, nargs="+", default=[8, 16], help="K (default 8 16)")
    parser.add_argument("--dim", type=int, default=1024, help="feature dimension d (default 1024)")
    parser.add_argument("--rows", type=int, default=300, help="rows per site (default 300)")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["python"],
        help="Flower engines for afl's app: python (simulation engine from Python, default), "
        "simulation (flwr run, local SuperLink), deployment (flwr run, a SuperNode per site)",
    )
    parser.add_argument(
        "--no-secaggplus", action="store_true", help="leave out Flower's own SecAgg+ rounds"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    """Run the bench at each K and write JSON."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        print(
            "afl bench flower: the Flower extra is not installed (make venv installs it; "
            "docs/flower.md §1)",
            file=sys.stderr,
        )
        return 2
    machine = describe_machine()
    print(format_machine(machine), file=sys.stderr)
    results = [
        run_flower_bench(
            num_sites=k,
            d=args.dim,
            rows=args.rows,
            engines=args.engines,
            flower_secaggplus=not args.no_secaggplus,
            seed=args.seed,
        )
        for k in args.sites
    ]
    emit_json({"benchmark": "flower", "machine": machine, "results": results}, args.out)
    return 0
