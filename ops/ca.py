"""`afl ca`: the operator's side of production provisioning (docs/operations.md §2; front end of
:mod:`afl.ops.provisioning`). No command here ever sees a site's private key.

    afl ca init --out CA_DIR [--federation-id ID] [passphrase]        offline CA machine
    afl ca server-init --kit DIR --host HOST [--host ...] [--port N]  on the coordinator's host
    afl ca sign --ca CA_DIR --out OUT REQUEST.json ... [passphrase]   offline CA machine
    afl ca admin-kit --ca CA_DIR --roster OUT/roster.json --name NAME --out DIR [passphrase]
                                                                      the operator's admin kit
    afl ca revoke --ca CA_DIR --out OUT SITE|--cert FILE [passphrase] offline CA machine

The CA key's passphrase comes from ``--passphrase-file FILE`` (its first line),
``--passphrase-env VAR``, or a prompt on a terminal; ``afl ca init --no-passphrase`` stores the
key unencrypted (tests, or a CA key kept in a hardware-protected store).
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from afl.crypto.identity import custody, pki
from afl.crypto.identity.custody import CustodyError
from afl.crypto.identity.pki import PkiError
from afl.ops.provisioning import (
    DEFAULT_PORT,
    ProvisioningError,
    ca_key_is_encrypted,
    init_ca,
    init_server_kit,
    load_ca,
    revoke_certificate,
    sign_requests,
    write_admin_kit,
)

__all__ = ["add_arguments", "run"]


class PassphraseError(ValueError):
    """No usable passphrase (the message says how to give one)."""


def _passphrase_options(parser: argparse.ArgumentParser, *, allow_none: bool) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--passphrase-file", metavar="FILE", help="the CA key passphrase (first line)"
    )
    group.add_argument(
        "--passphrase-env", metavar="VAR", help="environment variable holding the CA passphrase"
    )
    if allow_none:
        group.add_argument(
            "--no-passphrase",
            action="store_true",
            help="store ca.key unencrypted (tests; or a machine whose disk is protected otherwise)",
        )


def _passphrase(args: argparse.Namespace, *, confirm: bool) -> bytes | None:
    """The CA passphrase from the options, or a terminal prompt; :class:`PassphraseError`."""
    if getattr(args, "no_passphrase", False):
        return None
    if args.passphrase_file:
        try:
            lines = Path(args.passphrase_file).read_bytes().splitlines()
        except OSError as exc:
            raise PassphraseError(f"cannot read {args.passphrase_file}: {exc.strerror}") from exc
        value = lines[0] if lines else b""
        source = args.passphrase_file
    elif args.passphrase_env:
        value = os.environ.get(args.passphrase_env, "").encode()
        source = f"${args.passphrase_env}"
    elif sys.stdin.isatty():
        value = getpass.getpass("CA key passphrase: ").encode()
        if confirm and getpass.getpass("again: ").encode() != value:
            raise PassphraseError("the two passphrases differ")
        source = "the prompt"
    else:
        raise PassphraseError(
            "the CA key needs a passphrase: give --passphrase-file FILE or --passphrase-env VAR"
            + (" (or --no-passphrase)" if confirm else "")
        )
    if not value:
        raise PassphraseError(f"the passphrase from {source} is empty")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl ca` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="ca_command", required=True, metavar="STEP")
    init = sub.add_parser(
        "init",
        help="create the federation CA (offline machine)",
        description="Create the federation CA: CA_DIR/ca.pem, ca.key (0600, encrypted with the "
        "passphrase) and federation.toml. Keep CA_DIR offline.",
    )
    init.add_argument("--out", required=True, metavar="CA_DIR", help="folder for the CA")
    init.add_argument("--federation-id", default=None, help="federation id (default: random)")
    init.add_argument("--valid-days", type=int, default=3650, help="CA validity (days)")
    init.add_argument("--force", action="store_true", help="replace an existing CA in CA_DIR")
    _passphrase_options(init, allow_none=True)

    server = sub.add_parser(
        "server-init",
        help="make the coordinator's keys and request (on the coordinator's host)",
        description="Generate the coordinator's TLS key and Ed25519 identity key in its kit "
        "folder (0600; they never leave it) and write the public server.request.json for "
        "`afl ca sign`.",
    )
    server.add_argument("--kit", required=True, help="the coordinator's kit folder")
    server.add_argument(
        "--host",
        dest="hosts",
        action="append",
        required=True,
        metavar="HOST",
        help="host name or IP sites dial (repeatable; the first goes into client.toml)",
    )
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="the coordinator's port")
    server.add_argument("--force", action="store_true", help="replace the kit's existing keys")

    sign = sub.add_parser(
        "sign",
        help="check the requests and sign them into public bundles (offline machine)",
        description="Check every request (the server's and each site's: CSR self-signature, "
        "ECDSA P-256, the names asked for, the identity proof), sign them with the CA and write "
        "public material only: OUT/roster.json, OUT/server/ and OUT/sites/<id>/. Compare each "
        "printed request fingerprint with the one its site read to you before sending anything.",
    )
    sign.add_argument("requests", nargs="+", metavar="REQUEST.json", help="request files")
    sign.add_argument("--ca", required=True, metavar="CA_DIR", help="the folder of `afl ca init`")
    sign.add_argument("--out", required=True, help="folder for the public bundles")
    sign.add_argument(
        "--valid-days", type=int, default=pki.LEAF_VALID_DAYS, help="certificate validity (days)"
    )
    sign.add_argument("--force", action="store_true", help="replace existing bundles in --out")
    _passphrase_options(sign, allow_none=False)

    admin = sub.add_parser(
        "admin-kit",
        help="issue an operator's admin kit for `afl admin` (offline machine)",
        description="Make an admin key and certificate (URI SAN afl-admin:NAME) and admin.toml "
        "in DIR, for `afl admin --config DIR/admin.toml`. The coordinator serves NAME only if "
        "server.toml [admins] names lists it ('operator' is listed by default).",
    )
    admin.add_argument("--ca", required=True, metavar="CA_DIR", help="the folder of `afl ca init`")
    admin.add_argument("--roster", required=True, help="roster.json written by `afl ca sign`")
    admin.add_argument("--name", default="operator", help="the admin's name")
    admin.add_argument("--out", required=True, metavar="DIR", help="folder for the admin kit")
    _passphrase_options(admin, allow_none=False)

    revoke = sub.add_parser(
        "revoke",
        help="revoke a site's (or any) certificate: add it to the CA's revocation list",
        description="Add the certificate of SITE (OUT/sites/SITE/site.pem) or of --cert FILE to "
        "OUT/server/crl.pem, signed again with the CA key (entries already listed stay). Copy "
        "crl.pem into the coordinator's kit: from then on every call with that certificate is "
        "refused (no restart needed). Offboarding and rotation: docs/operations.md §12.",
    )
    revoke.add_argument("site", nargs="?", default=None, metavar="SITE", help="the site id")
    revoke.add_argument("--cert", default=None, metavar="FILE", help="a certificate file instead")
    revoke.add_argument("--ca", required=True, metavar="CA_DIR", help="the folder of `afl ca init`")
    revoke.add_argument("--out", required=True, help="the folder `afl ca sign` wrote")
    _passphrase_options(revoke, allow_none=False)


def _error(args: argparse.Namespace, message: object) -> int:
    print(f"afl ca {args.ca_command}: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the `afl ca` step ``args`` names. Returns the process exit code."""
    try:
        if args.ca_command == "init":
            folder, federation_id = init_ca(
                args.out,
                federation_id=args.federation_id,
                passphrase=_passphrase(args, confirm=True),
                valid_days=args.valid_days,
                force=args.force,
            )
            print(f"federation {federation_id}: CA in {folder} (keep {folder / 'ca.key'} offline)")
            return 0
        if args.ca_command == "server-init":
            path, request = init_server_kit(
                args.kit, hosts=args.hosts, port=args.port, force=args.force
            )
            print(f"coordinator {request.name}: keys written to {args.kit} (0600)")
            print(f"  request for the CA: {path}")
            print(f"  fingerprint: {request.fingerprint}")
            return 0
        encrypted = ca_key_is_encrypted(args.ca)
        if args.ca_command == "revoke":
            done = revoke_certificate(
                args.ca,
                args.out,
                passphrase=_passphrase(args, confirm=False) if encrypted else None,
                site=args.site,
                certificate=args.cert,
            )
            print(f"revoked {done.subject} (serial {done.serial:x}): {done.crl_path}")
            print(f"  {done.revoked} certificate(s) listed; copy it into the coordinator's kit")
            return 0
        if args.ca_command == "admin-kit":
            ca, _ = load_ca(
                args.ca, passphrase=_passphrase(args, confirm=False) if encrypted else None
            )
            roster = custody.roster_from_json(Path(args.roster).read_text(encoding="utf-8"))
            kit = write_admin_kit(Path(args.out), ca=ca, name=args.name, roster=roster)
            print(f"admin kit of {args.name!r} in {kit} (admin.key is a secret)")
            return 0
        signed = sign_requests(
            args.ca,
            args.requests,
            args.out,
            passphrase=_passphrase(args, confirm=False) if encrypted else None,
            valid_days=args.valid_days,
            force=args.force,
        )
    except (ProvisioningError, CustodyError, PkiError, PassphraseError, OSError) as exc:
        return _error(args, exc)
    print(f"federation {signed.roster.federation_id}: signed into {signed.root}")
    for request in signed.requests:
        print(f"  {request.what:28s} fingerprint {request.fingerprint}")
    print(f"  coordinator kit: {signed.server_dir}  (copy into the coordinator's kit)")
    for site_id, folder in signed.site_dirs.items():
        print(f"  site bundle:     {folder}  (send to {site_id})")
    print(f"  roster fingerprint: {signed.roster.fingerprint}")
    print("  compare each request fingerprint with its site's; publish the roster fingerprint")
    return 0
