"""`afl audit-export`: the audit bundle of a coordinator, and its offline verification
(:mod:`afl.ops.audit_bundle`; docs/compliance.md "Access, audit and evidence").

    afl audit-export --config server.toml --out BUNDLE [--run RUN_ID]
    afl audit-export --verify BUNDLE [--server-key HEX] [--json]

The export runs on the coordinator's host: it reads server.toml (the state directory, the
identity key that signs the bundle's manifest, the roster) and the state read-only, so it may run
beside a running afl-server. The verification needs only the bundle; ``--server-key`` pins the
coordinator's identity public key as the auditor knows it (the federation's roster.json).

Exit status: 0 exported / verified, 1 the bundle does not verify (tampered), 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys

from afl.ops.verify_log_cmd import hex32

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl audit-export` options to ``parser``."""
    parser.add_argument("--config", metavar="SERVER_TOML", help="the coordinator's server.toml")
    parser.add_argument("--out", metavar="BUNDLE", help="new folder to write the bundle into")
    parser.add_argument("--run", default="", metavar="RUN_ID", help="one run (default: all)")
    parser.add_argument("--verify", metavar="BUNDLE", help="verify a bundle offline instead")
    parser.add_argument(
        "--server-key", type=hex32, default=None, metavar="HEX", help="coordinator key to pin"
    )
    parser.add_argument("--json", action="store_true", help="print the verification as JSON")


def run(args: argparse.Namespace) -> int:
    """Export or verify; the process exit code."""
    from afl.ops.audit_bundle import BundleError

    try:
        if args.verify:
            return _verify(args)
        if not args.config or not args.out:
            print(
                "afl audit-export: error: give --config SERVER_TOML and --out BUNDLE (or "
                "--verify BUNDLE)",
                file=sys.stderr,
            )
            return 2
        return _export(args)
    except BundleError as exc:
        print(f"afl audit-export: error: {exc}", file=sys.stderr)
        return 2


def _export(args: argparse.Namespace) -> int:
    from afl.crypto.errors import CryptoError
    from afl.crypto.identity.signatures import load_private_key_pem
    from afl.ops.audit_bundle import BundleError, export_bundle
    from afl.server.config import load_config
    from afl.server.errors import ConfigError

    try:
        config = load_config(args.config)
        key = load_private_key_pem(config.identity_key.read_bytes())
    except (ConfigError, OSError, CryptoError) as exc:
        raise BundleError(str(exc)) from exc
    manifest = export_bundle(
        config.state_dir,
        args.out,
        identity_key=key,
        sites={s: (e.identity_public_key, e.role) for s, e in config.sites.items()},
        run_id=args.run,
    )
    print(
        f"exported {len(manifest['runs'])} run(s), {manifest['audit']['count']} audit records "
        f"and {len(manifest['files'])} files to {args.out}"
    )
    print(f"coordinator key {manifest['server_identity_public_key']} (compare with the roster)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from afl.ops.audit_bundle import verify_bundle

    report = verify_bundle(args.verify, server_key=args.server_key)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
        return 0 if report.ok else 1
    for problem in report.problems:
        print(f"TAMPERED: {problem}")
    for run_id, doc in report.runs.items():
        print(f"{run_id} ({doc['state']}), submitted by {doc['submitted_by']}")
        for round_id, rnd in doc["rounds"].items():
            consents = ", ".join(f"{s} {c}" for s, c in sorted(rnd["consents"].items()))
            print(f"  round {round_id}: consents {consents or 'none kept'}")
            for d in rnd["decoded"]:
                who = ", ".join(d["contributors"])
                print(f"    decoded {d['release']} sha256:{d['sha256'][:16]} over {who}")
            for name, why in sorted(rnd["withheld"].items()):
                print(f"    withheld {name}: {why}")
        for r in doc["recipients"]:
            print(f"  {r['what']} of {r['round_id']} sent to {r['role']} {r['who']}")
        for r in doc["refused"]:
            print(f"  {r['what']} refused to {r['who']}")
        for d in doc["deletions"]:
            print(f"  deleted {len(d['payloads'])} payloads, {len(d['messages'])} messages")
    if report.ok:
        print(f"OK: the bundle verifies (coordinator key {report.server_key})")
    return 0 if report.ok else 1
