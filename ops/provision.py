"""`afl provision`: command-line front end of :func:`afl.ops.provisioning.provision`.

afl provision --out DIR --site hospital-a --site hospital-b [--server-host HOST ...]
              [--port 50051] [--federation-id ID] [--decryptor SITE] [--allow-plaintext]
              [--force]

DEMO AND TESTS ONLY: it generates every site's private keys in one place, so whoever runs it
holds them all (docs/protocol.md M-70). Production: `afl ca` (:mod:`afl.ops.ca`) and
`afl-client init` (docs/operations.md §2).
"""

from __future__ import annotations

import argparse
import sys

from afl.crypto.identity import pki
from afl.crypto.identity.pki import PkiError
from afl.ops.provisioning import DEFAULT_PORT, ProvisioningError, provision

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl provision` options to ``parser``."""
    parser.description = (
        "DEMO AND TESTS ONLY: create a federation CA, the coordinator's kit and one kit per site "
        "in one folder. Every site's TLS and identity private keys are generated HERE, so "
        "whoever runs this holds them all and could impersonate any site. For a real federation "
        "each site runs `afl-client init` and the operator `afl ca` (docs/operations.md §2)."
    )
    parser.add_argument("--out", required=True, help="folder to write the federation into")
    parser.add_argument(
        "--site",
        dest="sites",
        action="append",
        required=True,
        metavar="SITE_ID",
        help="site id (repeat for each site), e.g. hospital-a",
    )
    parser.add_argument(
        "--server-host",
        dest="server_hosts",
        action="append",
        metavar="HOST",
        help="host name or IP clients dial (repeatable; the first goes into client.toml; "
        "localhost and 127.0.0.1 are always in the certificate). Default: localhost",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port")
    parser.add_argument("--federation-id", default=None, help="federation id (default: random)")
    parser.add_argument(
        "--decryptor", default=None, metavar="SITE_ID", help="site holding the CKKS secret key"
    )
    parser.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="DEVELOPMENT: let the kits' [policy] accept aggregation = 'plaintext' (by default "
        "a site refuses any plan that shows the coordinator its statistics in the clear)",
    )
    parser.add_argument(
        "--valid-days",
        type=int,
        default=pki.LEAF_VALID_DAYS,
        help="validity of server and site certificates",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing federation in --out (its CA and every kit are replaced)",
    )


def run(args: argparse.Namespace) -> int:
    """Provision as ``args`` says; print where the kits are. Returns the process exit code."""
    try:
        result = provision(
            args.out,
            sites=args.sites,
            server_hosts=args.server_hosts or ["localhost"],
            port=args.port,
            federation_id=args.federation_id,
            decryptor=args.decryptor,
            allow_plaintext=args.allow_plaintext,
            valid_days=args.valid_days,
            force=args.force,
        )
    except (ProvisioningError, PkiError) as exc:
        print(f"afl provision: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"federation {result.federation_id} provisioned in {result.root} (demo/tests only: "
        "every site's private keys were generated here)"
    )
    print(f"  CA certificate: {result.ca_cert}  (keep {result.root / 'ca.key'} offline)")
    print(f"  server kit:     {result.server_dir}  (afl-server --config server.toml)")
    for site_id, kit in result.site_dirs.items():
        print(f"  site kit:       {kit}  ({site_id}; send this folder to the site securely)")
    print(f"  clients dial:   {result.server_address}")
    return 0
