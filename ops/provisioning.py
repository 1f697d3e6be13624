"""Provisioning a federation (docs/protocol.md §1, docs/operations.md §2; the model is NVFlare's
distributed provisioning).

Production (M-70): every party makes its own keys where it runs and the operator signs requests.

1. :func:`init_ca` (``afl ca init``, the operator's offline machine): the federation CA
   (``ca.pem``; ``ca.key`` 0600, encrypted with a passphrase unless the operator opts out) and
   ``federation.toml`` (the federation id).
2. :func:`init_server_kit` (``afl ca server-init``, on the coordinator's host): ``server.key`` and
   ``identity.key`` (0600) and the public ``server.request.json``
   (:mod:`afl.crypto.identity.custody`). Each site does the same with ``afl-client init``
   (:mod:`afl.client.kit`).
3. :func:`sign_requests` (``afl ca sign``, offline, with the CA key): checks every request
   (:meth:`afl.crypto.identity.custody.KeyRequest.verify`), signs the CSRs and writes public material only::

       roster.json              federation id, server address, CA certificate, server identity key,
                                every site's identity key and role (afl.crypto.identity.custody.Roster)
       server/                  ca.pem, server.pem, server.toml ([sites] from the requests), roster.json,
                                crl.pem (the CA's revocation list: empty, or kept from before)
       sites/<id>/              ca.pem, site.pem, client.toml (template, no [policy]), roster.json

   The operator copies ``server/`` into the coordinator's kit and sends each site its folder;
   ``afl-client init --import`` checks it against the site's own keys and the roster fingerprint.

Demo and tests only: :func:`provision` (``afl provision``) runs the same issuing code in one place
and therefore generates every site's private keys centrally; whoever runs it holds them all.
Layout written under ``out_dir``::

    federation.toml          federation id, server address, every site's identity public key
    ca.pem                   federation CA certificate
    ca.key           0600    CA private key
    roster.json              the roster (as above)
    server/          0700    ca.pem, server.pem, server.key (0600), identity.key (0600), server.toml,
                             roster.json, crl.pem
    admins/<name>/   0700    ca.pem, admin.pem, admin.key (0600), admin.toml (for `afl admin`)
    sites/<id>/      0700    ca.pem, site.pem, site.key (0600), identity.key (0600), client.toml,
                             roster.json

TLS keys are ECDSA P-256 (:mod:`afl.crypto.identity.pki`); identity keys are Ed25519
(:mod:`afl.crypto.identity.signatures`): the server's signs release plans and models, a site's signs its
protocol messages. Each kit carries the server's and every peer's identity public key, so sites
verify signatures without trusting the server to relay keys. Paths inside the .toml files are
relative to the file's own folder, so a kit can be copied anywhere as a unit.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import math
import os
import secrets
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from afl.crypto.identity import custody, pki
from afl.crypto.identity.revocation import CRL_NAME, issue_crl, load_crl, revoked_serials
from afl.server import toml_text
from afl.server.config import round_template

__all__ = [
    "IssuedFederation",
    "ProvisionedFederation",
    "ProvisioningError",
    "Revocation",
    "SignedFederation",
    "ca_key_is_encrypted",
    "init_ca",
    "init_server_kit",
    "issue_federation",
    "load_ca",
    "provision",
    "revoke_certificate",
    "sign_requests",
    "write_admin_kit",
]

DEFAULT_PORT = 50051
SERVER_REQUEST = "server.request.json"
ROSTER = "roster.json"
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
_MARKERS = ("ca.key", "ca.pem", "federation.toml")


class ProvisioningError(ValueError):
    """Provisioning refused: bad arguments, or an existing federation without ``force``."""


@dataclass(frozen=True)
class ProvisionedFederation:
    """Where :func:`provision` wrote everything."""

    root: Path
    federation_id: str
    server_address: str
    ca_cert: Path
    server_dir: Path
    site_dirs: Mapping[str, Path]


def _address(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _mkdir_private(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_public(path: Path, data: bytes) -> None:
    pki.write_private_file(path, data, mode=0o644)


def _check_arguments(
    sites: Sequence[str], hosts: Sequence[str], port: int, decryptor: str | None
) -> list[str]:
    if isinstance(sites, str) or not sites:
        raise ProvisioningError("at least one site id is required")
    site_ids = [pki.validate_site_id(s) for s in sites]
    duplicates = sorted({s for s in site_ids if site_ids.count(s) > 1})
    if duplicates:
        raise ProvisioningError(f"duplicate site ids: {', '.join(duplicates)}")
    _server_hosts(hosts)
    _check_port(port)
    if decryptor is not None and decryptor not in site_ids:
        raise ProvisioningError(f"decryptor {decryptor!r} is not one of the provisioned sites")
    return site_ids


def _server_toml(
    *,
    federation_id: str,
    listen: str,
    server_public: bytes,
    peers: Mapping[str, bytes],
    roles: Mapping[str, str],
    round_settings: Mapping[str, toml_text.TomlValue] | None,
    admins: Sequence[str] = (),
) -> str:
    document: dict[str, toml_text.TomlValue] = {
        "server": {"federation_id": federation_id, "listen": listen, "state_dir": "state"},
        # crl: the CA's revocation list (afl ca revoke); a listed certificate is refused.
        "tls": {"ca_cert": "ca.pem", "cert": "server.pem", "key": "server.key", "crl": CRL_NAME},
        "identity": {"key": "identity.key", "public_key": server_public.hex()},
        "sites": {
            site: {"identity_public_key": key.hex(), "role": roles[site]}
            for site, key in peers.items()
        },
        # Admin certificates allowed to use the Admin service (afl admin; docs/operations.md).
        "admins": {"names": list(admins)},
        # Payloads of a finished run are deleted after this many days (0: when the run ends).
        "retention": {"payload_days": 0},
        # Settings of the first run (afl.server.config): set classes and feature_dim before
        # starting; later runs are submitted with `afl admin submit`.
        "round": round_template(round_settings),
    }
    header = (
        "afl-server configuration, written by afl provisioning (docs/operations.md).\n"
        "Paths are relative to this file's folder. server.key and identity.key are secrets."
    )
    return toml_text.dumps(document, header=header)


def _client_toml(
    *,
    site_id: str,
    federation_id: str,
    server_address: str,
    role: str,
    site_public: bytes,
    server_public: bytes,
    peers: Mapping[str, bytes],
    policy: Mapping[str, toml_text.TomlValue] | None,
) -> str:
    """client.toml of a site. ``policy``: the all-in-one kits carry a [policy] table (the defaults
    plus these keys); the production template (None) does not (the site's own software defaults apply until its IT adds one;
    ``afl-client init --import`` refuses a template with a [policy])."""
    document: dict[str, toml_text.TomlValue] = {
        "client": {
            "site_id": site_id,
            "federation_id": federation_id,
            "server": server_address,
            "role": role,
            "state_dir": "state",
        },
        "tls": {"ca_cert": "ca.pem", "cert": "site.pem", "key": "site.key"},
        "identity": {
            "key": "identity.key",
            "public_key": site_public.hex(),
            "server_public_key": server_public.hex(),
        },
        "peers": {site: key.hex() for site, key in peers.items()},
        "data": {"cache": "cache", "classes": []},
    }
    if policy is not None:
        document["policy"] = {
            # Demo and tests: permissive (no DP budget, bounds disclosed); doctor lists it.
            "profile": "development",
            "min_cohort": 3,
            "allow_exposure": False,
            "max_epsilon": math.inf,
            **policy,
        }
    header = (
        f"afl-client configuration for site {site_id!r}, written by afl provisioning (docs/operations.md).\n"
        "Paths are relative to this file's folder. site.key and identity.key are secrets.\n"
        "Site IT: set [data] (feature cache, the classes this site labels); review or add [policy]."
    )
    if policy is not None:
        header += (
            "\nDEVELOPMENT KIT (afl provision, demo and tests): its [policy] is permissive (no DP "
            "budget, row bounds disclosed); never use it with real data."
        )
    return toml_text.dumps(document, header=header)


# --- issuing: the one path from checked requests to certificates and a roster --------------------


@dataclass(frozen=True)
class IssuedFederation:
    """Certificates and the roster issued from checked requests (public material only)."""

    roster: custody.Roster
    ca_pem: bytes
    server_certificate_pem: bytes
    site_certificates_pem: Mapping[str, bytes]
    listen: str


def issue_federation(
    ca: pki.CertifiedKey,
    *,
    federation_id: str,
    requests: Sequence[custody.KeyRequest],
    valid_days: int = pki.LEAF_VALID_DAYS,
) -> IssuedFederation:
    """Check every request (:meth:`afl.crypto.identity.custody.KeyRequest.verify`) and sign its CSR's
    public key: exactly one server request, at least one site request, distinct site ids, at most
    one decryptor. The CA chooses every extension; nothing is copied from a CSR.

    Raises:
        afl.crypto.identity.custody.CustodyError: a request fails its checks (the message names it).
        ProvisioningError: the set of requests is not a federation.
    """
    if not federation_id.strip():
        raise ProvisioningError("federation id must not be empty")
    keys = {id(r): r.verify() for r in requests}
    servers = [r for r in requests if r.kind == "server"]
    sites = sorted((r for r in requests if r.kind == "site"), key=lambda r: r.name)
    if len(servers) != 1:
        raise ProvisioningError(f"exactly one server request is needed, got {len(servers)}")
    if not sites:
        raise ProvisioningError("at least one site request is needed")
    names = [r.name for r in sites]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ProvisioningError(f"two requests for the same site: {', '.join(duplicates)}")
    decryptors = [r.name for r in sites if r.role == "decryptor"]
    if len(decryptors) > 1:
        raise ProvisioningError(f"at most one decryptor site, got {', '.join(decryptors)}")
    server = servers[0]
    server_certificate = pki.issue_server_certificate_for(
        ca,
        public_key=keys[id(server)],
        common_name=server.name,
        hosts=server.hosts,
        valid_days=valid_days,
    )
    site_certificates = {
        r.name: pki.certificate_to_pem(
            pki.issue_site_certificate_for(
                ca, public_key=keys[id(r)], site_id=r.name, valid_days=valid_days
            )
        )
        for r in sites
    }
    ca_pem = ca.certificate_pem()
    roster = custody.Roster(
        federation_id=federation_id,
        server_address=_address(server.name, server.port),
        ca_certificate_pem=ca_pem,
        server_identity_public_key=server.identity_public_key,
        sites={r.name: custody.RosterSite(r.identity_public_key, r.role) for r in sites},
    )
    loopback = server.name in _LOOPBACK_NAMES
    return IssuedFederation(
        roster=roster,
        ca_pem=ca_pem,
        server_certificate_pem=pki.certificate_to_pem(server_certificate),
        site_certificates_pem=site_certificates,
        listen=_address("127.0.0.1" if loopback else "0.0.0.0", server.port),
    )


def _write_server_files(
    folder: Path,
    issued: IssuedFederation,
    round_settings: Mapping[str, toml_text.TomlValue] | None,
    admins: Sequence[str],
    *,
    crl_pem: bytes,
) -> None:
    roster = issued.roster
    _mkdir_private(folder)
    _write_public(folder / "ca.pem", issued.ca_pem)
    _write_public(folder / CRL_NAME, crl_pem)
    _write_public(folder / "server.pem", issued.server_certificate_pem)
    _write_public(folder / ROSTER, roster.to_json().encode())
    text = _server_toml(
        federation_id=roster.federation_id,
        listen=issued.listen,
        server_public=roster.server_identity_public_key,
        peers=roster.identity_keys(),
        roles={s: e.role for s, e in roster.sites.items()},
        round_settings=round_settings,
        admins=admins,
    )
    _write_public(folder / "server.toml", text.encode())


def write_admin_kit(
    kit: Path,
    *,
    ca: pki.CertifiedKey,
    name: str,
    roster: custody.Roster,
    valid_days: int = pki.LEAF_VALID_DAYS,
) -> Path:
    """An operator's admin kit, made where the CA is (the operator is its holder): ca.pem,
    admin.pem (URI SAN ``afl-admin:<name>``), admin.key (0600) and admin.toml for ``afl admin
    --config`` (with the server's identity public key, to verify downloaded models). The server
    must list ``name`` in server.toml [admins] names."""
    _mkdir_private(kit.parent)
    _mkdir_private(kit)
    certified = pki.issue_admin_certificate(ca, name=name, valid_days=valid_days)
    _write_public(kit / "ca.pem", ca.certificate_pem())
    _write_public(kit / "admin.pem", certified.certificate_pem())
    pki.write_private_file(kit / "admin.key", certified.private_key_pem())
    document: dict[str, toml_text.TomlValue] = {
        "admin": {
            "name": name,
            "federation_id": roster.federation_id,
            "server": roster.server_address,
            "server_public_key": roster.server_identity_public_key.hex(),
        },
        "tls": {"ca_cert": "ca.pem", "cert": "admin.pem", "key": "admin.key"},
    }
    header = (
        f"afl admin configuration of {name!r} (docs/operations.md).\n"
        "Paths are relative to this file's folder. admin.key is a secret."
    )
    _write_public(kit / "admin.toml", toml_text.dumps(document, header=header).encode())
    return kit


def _write_site_files(
    folder: Path,
    issued: IssuedFederation,
    site_id: str,
    *,
    policy: Mapping[str, toml_text.TomlValue] | None,
) -> None:
    roster = issued.roster
    entry = roster.sites[site_id]
    _mkdir_private(folder)
    _write_public(folder / "ca.pem", issued.ca_pem)
    _write_public(folder / "site.pem", issued.site_certificates_pem[site_id])
    _write_public(folder / ROSTER, roster.to_json().encode())
    text = _client_toml(
        site_id=site_id,
        federation_id=roster.federation_id,
        server_address=roster.server_address,
        role=entry.role,
        site_public=entry.identity_public_key,
        server_public=roster.server_identity_public_key,
        peers=roster.identity_keys(),
        policy=policy,
    )
    _write_public(folder / "client.toml", text.encode())


def _write_private_keys(folder: Path, keys: custody.PrivateKeys, *, tls_name: str) -> None:
    pki.write_private_file(folder / tls_name, keys.tls_pem())
    pki.write_private_file(folder / "identity.key", keys.identity_pem())


def _refuse_existing(root: Path, markers: Sequence[str], force: bool, what: str) -> None:
    existing = [m for m in markers if (root / m).exists()]
    if existing and not force:
        raise ProvisioningError(
            f"{root} already holds {what} ({', '.join(existing)}); refusing to overwrite "
            "(use --force to replace it)"
        )


def _manifest(issued: IssuedFederation) -> bytes:
    roster = issued.roster
    federation: dict[str, toml_text.TomlValue] = {
        "federation": {
            "federation_id": roster.federation_id,
            "server_address": roster.server_address,
            "server_identity_public_key": roster.server_identity_public_key.hex(),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        },
        "sites": {
            s: {"identity_public_key": e.identity_public_key.hex(), "role": e.role}
            for s, e in roster.sites.items()
        },
    }
    header = "Federation manifest, written by afl provisioning."
    return toml_text.dumps(federation, header=header).encode()


# --- production: the operator's CA, the server's own keys, signing requests ----------------------


def init_ca(
    out_dir: str | os.PathLike[str],
    *,
    federation_id: str | None = None,
    passphrase: bytes | None,
    valid_days: int = 3650,
    force: bool = False,
) -> tuple[Path, str]:
    """Create the federation CA in ``out_dir`` (``ca.pem``, ``ca.key`` encrypted with
    ``passphrase`` unless it is None, ``federation.toml``); returns (folder, federation id).

    Raises:
        ProvisioningError: ``out_dir`` already holds a CA and ``force`` is false, or an empty
            federation id or passphrase.
    """
    root = Path(out_dir)
    _refuse_existing(root, _MARKERS, force, "a federation CA")
    fed_id = federation_id or f"fed-{secrets.token_hex(6)}"
    if not fed_id.strip():
        raise ProvisioningError("federation id must not be empty")
    if passphrase is not None and not passphrase:
        raise ProvisioningError("the CA key passphrase must not be empty")
    ca = pki.create_ca(common_name=f"afl federation CA {fed_id}", valid_days=valid_days)
    _mkdir_private(root)
    pki.write_private_file(
        root / "ca.key", pki.tls_private_key_to_pem(ca.private_key, passphrase=passphrase)
    )
    _write_public(root / "ca.pem", ca.certificate_pem())
    document: dict[str, toml_text.TomlValue] = {
        "federation": {
            "federation_id": fed_id,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
    }
    header = "Federation CA, written by `afl ca init`. ca.key is the CA's secret: keep it offline."
    _write_public(root / "federation.toml", toml_text.dumps(document, header=header).encode())
    return root, fed_id


def ca_key_is_encrypted(ca_dir: str | os.PathLike[str]) -> bool:
    """Whether ``ca_dir/ca.key`` is passphrase-protected (:class:`ProvisioningError` if absent)."""
    return pki.is_encrypted_pem(_read(Path(ca_dir) / "ca.key", "the CA key"))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ProvisioningError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def load_ca(
    ca_dir: str | os.PathLike[str], *, passphrase: bytes | None
) -> tuple[pki.CertifiedKey, str]:
    """The CA of ``ca_dir`` (from :func:`init_ca`) and its federation id.

    Raises:
        ProvisioningError: a file is missing or unreadable, the key is encrypted and no (or the
            wrong) passphrase was given, or the key does not belong to ``ca.pem``.
    """
    root = Path(ca_dir)
    key_path = root / "ca.key"
    try:
        key = pki.load_tls_private_key_pem(_read(key_path, "the CA key"), passphrase=passphrase)
        certificate = pki.load_certificate_pem(_read(root / "ca.pem", "the CA certificate"))
    except pki.PkiError as exc:
        raise ProvisioningError(f"cannot open the CA key {key_path}: {exc}") from exc
    if certificate.public_key() != key.public_key():
        raise ProvisioningError(f"{key_path} is not the key of {root / 'ca.pem'}")
    try:
        document = tomllib.loads(
            _read(root / "federation.toml", "the CA's federation file").decode()
        )
        federation_id = document["federation"]["federation_id"]
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise ProvisioningError(f"{root / 'federation.toml'} names no federation_id") from exc
    if not isinstance(federation_id, str) or not federation_id.strip():
        raise ProvisioningError(f"{root / 'federation.toml'} names no federation_id")
    return pki.CertifiedKey(certificate=certificate, private_key=key), federation_id


def _server_hosts(hosts: Sequence[str]) -> list[str]:
    """``hosts`` plus ``localhost`` and ``127.0.0.1`` (local health checks), first host first."""
    if isinstance(hosts, str) or not hosts:
        raise ProvisioningError("server hosts must be a non-empty sequence of names/addresses")
    return [*hosts, *(h for h in ("localhost", "127.0.0.1") if h not in hosts)]


def _check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ProvisioningError(f"port must be in 1..65535, got {port!r}")
    return port


def init_server_kit(
    kit_dir: str | os.PathLike[str],
    *,
    hosts: Sequence[str],
    port: int = DEFAULT_PORT,
    force: bool = False,
) -> tuple[Path, custody.KeyRequest]:
    """Make the coordinator's keys in ``kit_dir`` where it runs: ``server.key`` and
    ``identity.key`` (0600) and the public request ``server.request.json`` for the operator to
    sign; returns (request path, request). ``hosts[0]`` is the name clients dial; ``localhost`` and
    ``127.0.0.1`` are added to the certificate request.

    Raises:
        ProvisioningError: bad hosts or port, or the kit already holds keys and ``force`` is
            false.
        afl.crypto.identity.pki.PkiError: a malformed host name.
    """
    kit = Path(kit_dir)
    _refuse_existing(kit, ("server.key", "identity.key"), force, "the server's keys")
    keys, request = custody.new_server_request(hosts=_server_hosts(hosts), port=_check_port(port))
    _mkdir_private(kit)
    _write_private_keys(kit, keys, tls_name="server.key")
    _write_public(kit / SERVER_REQUEST, request.to_json().encode())
    return kit / SERVER_REQUEST, request


@dataclass(frozen=True)
class SignedFederation:
    """Where :func:`sign_requests` wrote the public material."""

    root: Path
    roster: custody.Roster
    requests: Sequence[custody.KeyRequest]
    server_dir: Path
    site_dirs: Mapping[str, Path]


def sign_requests(
    ca_dir: str | os.PathLike[str],
    request_files: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    passphrase: bytes | None,
    valid_days: int = pki.LEAF_VALID_DAYS,
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    force: bool = False,
    admins: Sequence[str] = ("operator",),
) -> SignedFederation:
    """Check the request files (one server request, the sites'), sign them with the CA of
    ``ca_dir`` and write public material only under ``out_dir`` (layout in the module docstring).

    Raises:
        ProvisioningError: unreadable files, the CA cannot be opened, ``out_dir`` already holds a
            signed federation and ``force`` is false, or the requests do not form a federation.
        afl.crypto.identity.custody.CustodyError: a request fails its checks (the message names it).
    """
    ca, federation_id = load_ca(ca_dir, passphrase=passphrase)
    requests = []
    for path in request_files:
        text = _read(Path(path), "the request file")
        try:
            requests.append(custody.request_from_json(text.decode("utf-8")))
        except (custody.CustodyError, UnicodeDecodeError) as exc:
            raise custody.CustodyError(f"{path}: {exc}") from exc
    issued = issue_federation(
        ca, federation_id=federation_id, requests=requests, valid_days=valid_days
    )
    try:
        round_template(round_settings)
    except ValueError as exc:
        raise ProvisioningError(str(exc)) from exc
    root = Path(out_dir)
    _refuse_existing(root, (ROSTER, "server", "sites"), force, "signed material")
    revoked = _revoked(root / "server" / CRL_NAME, ca)  # a re-signing keeps every revocation
    _mkdir_private(root)
    _write_public(root / ROSTER, issued.roster.to_json().encode())
    _write_server_files(
        root / "server", issued, round_settings, admins, crl_pem=issue_crl(ca, revoked=revoked)
    )
    site_dirs = {}
    for site_id in issued.roster.sites:
        site_dirs[site_id] = root / "sites" / site_id
        _mkdir_private(root / "sites")
        _write_site_files(site_dirs[site_id], issued, site_id, policy=None)
    return SignedFederation(
        root=root,
        roster=issued.roster,
        requests=tuple(requests),
        server_dir=root / "server",
        site_dirs=site_dirs,
    )


def _revoked(crl_path: Path, ca: pki.CertifiedKey) -> dict[int, dt.datetime]:
    """The entries of the CA's existing revocation list at ``crl_path`` (none if absent)."""
    if not crl_path.is_file():
        return {}
    try:
        crl = load_crl(_read(crl_path, "the revocation list"), ca_certificate=ca.certificate)
    except pki.PkiError as exc:
        raise ProvisioningError(f"{crl_path}: {exc}") from exc
    return revoked_serials(crl)


@dataclass(frozen=True)
class Revocation:
    """What :func:`revoke_certificate` did."""

    crl_path: Path
    serial: int
    subject: str
    revoked: int


def revoke_certificate(
    ca_dir: str | os.PathLike[str],
    signed_dir: str | os.PathLike[str],
    *,
    passphrase: bytes | None,
    site: str | None = None,
    certificate: str | os.PathLike[str] | None = None,
) -> Revocation:
    """Add a certificate issued by the CA of ``ca_dir`` (a site's, from ``signed_dir``'s bundle,
    or any file given as ``certificate``) to the revocation list ``signed_dir/server/crl.pem``,
    signed again by the CA (docs/operations.md §12, M-173). Entries already listed stay.

    Raises:
        ProvisioningError: the CA cannot be opened, the certificate is missing or not issued by
            this CA, or the existing list does not verify.
    """
    ca, _ = load_ca(ca_dir, passphrase=passphrase)
    root = Path(signed_dir)
    if (site is None) == (certificate is None):
        raise ProvisioningError("name the certificate to revoke: a site id or --cert FILE")
    path = root / "sites" / str(site) / "site.pem" if certificate is None else Path(certificate)
    try:
        leaf = pki.load_certificate_pem(_read(path, "the certificate to revoke"))
        leaf.verify_directly_issued_by(ca.certificate)
    except (pki.PkiError, ValueError, TypeError, InvalidSignature) as exc:
        raise ProvisioningError(f"{path} is not a certificate of this federation's CA") from exc
    crl_path = root / "server" / CRL_NAME
    revoked = _revoked(crl_path, ca)
    revoked.setdefault(leaf.serial_number, dt.datetime.now(dt.UTC))
    _write_public(crl_path, issue_crl(ca, revoked=revoked))
    return Revocation(crl_path, leaf.serial_number, leaf.subject.rfc4514_string(), len(revoked))


# --- demo and tests: everything in one place -----------------------------------------------------


def site_policy(
    *, decryptor: str | None, allow_plaintext: bool, gram_scope: object
) -> dict[str, toml_text.TomlValue]:
    """The [policy] keys a kit pins (docs/protocol.md §2): the protections the site accepts
    (plaintext only with ``allow_plaintext``), the CKKS decryptor, and coverage disclosure,
    which only a per-class federation needs."""
    policy: dict[str, toml_text.TomlValue] = {
        "allowed_aggregation": ["plaintext", "mask", "ckks"]
        if allow_plaintext
        else ["mask", "ckks"],
        "disclose_coverage": gram_scope == "per-class",
    }
    if decryptor is not None:
        policy["ckks_decryptor"] = decryptor
    return policy


def provision(
    out_dir: str | os.PathLike[str],
    *,
    sites: Sequence[str],
    server_hosts: Sequence[str] = ("localhost",),
    port: int = DEFAULT_PORT,
    federation_id: str | None = None,
    decryptor: str | None = None,
    valid_days: int = pki.LEAF_VALID_DAYS,
    force: bool = False,
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    admins: Sequence[str] = ("operator",),
    allow_plaintext: bool = False,
) -> ProvisionedFederation:
    """DEMO AND TESTS ONLY: create a whole federation under ``out_dir`` (layout in the module
    docstring), generating every site's private keys here (M-70: production uses
    :func:`init_ca`, ``afl-client init``, :func:`init_server_kit` and :func:`sign_requests`).
    The certificates and roster come from the same :func:`issue_federation` as in production.

    ``server_hosts[0]`` is the address written into every client.toml; every host, plus
    ``localhost`` and ``127.0.0.1``, goes into the server certificate's subjectAltName.
    ``decryptor`` names the site that gets ``role = "decryptor"`` (CKKS mode, docs/protocol.md §4.3).
    ``round_settings`` overrides keys of server.toml's [round] table
    (:func:`afl.server.config.round_template`: classes, feature_dim, gram_scope, ...).
    ``admins`` get an admin kit each under ``admins/<name>/`` (:func:`write_admin_kit`).
    Every kit's [policy] allows ``mask`` and ``ckks`` only, plus ``plaintext`` with
    ``allow_plaintext`` (development; the sites opt in to sending statistics in the clear), pins
    ``decryptor`` as its CKKS decryptor, and discloses coverage only in a per-class federation.

    Raises:
        ProvisioningError: bad arguments, or ``out_dir`` already holds a federation (ca.pem,
            ca.key or federation.toml) and ``force`` is false.
        afl.crypto.identity.pki.PkiError: an invalid site id or host name.
    """
    site_ids = _check_arguments(sites, server_hosts, port, decryptor)
    try:  # unknown [round] keys fail before anything is written
        round_template(round_settings)
    except ValueError as exc:
        raise ProvisioningError(str(exc)) from exc
    root = Path(out_dir)
    existing = [m for m in _MARKERS if (root / m).exists()]
    if existing and not force:
        raise ProvisioningError(
            f"{root} already holds a federation ({', '.join(existing)}); refusing to overwrite "
            "its CA and keys (use --force to replace it; every site then needs its new kit)"
        )
    fed_id = federation_id or f"fed-{secrets.token_hex(6)}"
    if not fed_id.strip():
        raise ProvisioningError("federation id must not be empty")
    ca = pki.create_ca(common_name=f"afl federation CA {fed_id}", valid_days=max(valid_days, 3650))
    server_keys, server_request = custody.new_server_request(
        hosts=_server_hosts(server_hosts), port=port
    )
    site_keys: dict[str, custody.PrivateKeys] = {}
    requests = [server_request]
    for site_id in site_ids:
        role = "decryptor" if site_id == decryptor else "participant"
        site_keys[site_id], request = custody.new_site_request(site_id=site_id, role=role)
        requests.append(request)
    issued = issue_federation(ca, federation_id=fed_id, requests=requests, valid_days=valid_days)
    # A round cannot need more participants than there are data sites (the decryptor holds none).
    data_sites = sum(1 for s in site_ids if s != decryptor)
    round_settings = {"min_participants": max(1, min(3, data_sites)), **(round_settings or {})}

    if not root.exists():
        _mkdir_private(root)
    pki.write_private_file(root / "ca.key", ca.private_key_pem())
    _write_public(root / "ca.pem", issued.ca_pem)
    _write_public(root / ROSTER, issued.roster.to_json().encode())
    server_dir = root / "server"
    _write_server_files(
        server_dir, issued, round_settings, admins, crl_pem=issue_crl(ca, revoked={})
    )
    _write_private_keys(server_dir, server_keys, tls_name="server.key")
    for name in admins:
        write_admin_kit(root / "admins" / name, ca=ca, name=name, roster=issued.roster)
    kit_policy = site_policy(
        decryptor=decryptor,
        allow_plaintext=allow_plaintext,
        gram_scope=round_template(round_settings)["gram_scope"],
    )
    site_dirs: dict[str, Path] = {}
    for site_id in site_ids:
        _mkdir_private(root / "sites")
        kit = root / "sites" / site_id
        _write_site_files(kit, issued, site_id, policy=kit_policy)
        _write_private_keys(kit, site_keys[site_id], tls_name="site.key")
        site_dirs[site_id] = kit
    _write_public(root / "federation.toml", _manifest(issued))
    return ProvisionedFederation(
        root=root,
        federation_id=fed_id,
        server_address=issued.roster.server_address,
        ca_cert=root / "ca.pem",
        server_dir=server_dir,
        site_dirs=site_dirs,
    )
