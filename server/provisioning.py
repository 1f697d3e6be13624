"""`afl provision`: a federation CA, the server's credentials and one startup kit per site
(docs/protocol.md §1, docs/operations.md; the model is NVFlare's provisioning).

Layout written under ``out_dir``::

    federation.toml          federation id, server address, every site's identity public key
    ca.pem                   federation CA certificate
    ca.key           0600    CA private key: keep it offline; needed only to add sites later
    server/          0700    ca.pem, server.pem, server.key (0600), identity.key (0600), server.toml
    sites/<id>/      0700    ca.pem, site.pem, site.key (0600), identity.key (0600), client.toml

TLS keys are ECDSA P-256 (:mod:`afl.crypto.pki`); identity keys are Ed25519
(:mod:`afl.crypto.signatures`): the server's signs release plans and models, a site's signs its
protocol messages. Each kit carries the server's and every peer's identity public key, so sites
verify signatures without trusting the server to relay keys. Paths inside the .toml files are
relative to the file's own folder, so a kit can be copied anywhere as a unit.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from afl.crypto import pki, signatures
from afl.server import toml_text
from afl.server.config import round_template

__all__ = ["ProvisionedFederation", "ProvisioningError", "provision"]

DEFAULT_PORT = 50051
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
    if isinstance(hosts, str) or not hosts:
        raise ProvisioningError("server_hosts must be a non-empty sequence of names/addresses")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ProvisioningError(f"port must be in 1..65535, got {port!r}")
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
) -> str:
    document: dict[str, toml_text.TomlValue] = {
        "server": {"federation_id": federation_id, "listen": listen, "state_dir": "state"},
        "tls": {"ca_cert": "ca.pem", "cert": "server.pem", "key": "server.key"},
        "identity": {"key": "identity.key", "public_key": server_public.hex()},
        "sites": {
            site: {"identity_public_key": key.hex(), "role": roles[site]}
            for site, key in peers.items()
        },
        # Round settings (afl.server.config): set classes and feature_dim before starting.
        "round": round_template(round_settings),
    }
    header = (
        "afl-server configuration, written by `afl provision` (docs/operations.md).\n"
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
    policy: Mapping[str, toml_text.TomlValue],
) -> str:
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
        "data": {"cache_dir": "cache", "classes": []},
        "policy": {
            "min_cohort": 3,
            "allow_exposure": False,
            "max_epsilon": float("inf"),
            **policy,
        },
    }
    header = (
        f"afl-client configuration for site {site_id!r}, written by `afl provision` (docs/operations.md).\n"
        "Paths are relative to this file's folder. site.key and identity.key are secrets.\n"
        "Site IT: set [data] (feature cache, the classes this site labels) and review [policy]."
    )
    return toml_text.dumps(document, header=header)


def _site_policy(
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
    valid_days: int = 825,
    force: bool = False,
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    allow_plaintext: bool = False,
) -> ProvisionedFederation:
    """Create a federation under ``out_dir`` (layout in the module docstring).

    ``server_hosts[0]`` is the address written into every client.toml; every host, plus
    ``localhost`` and ``127.0.0.1``, goes into the server certificate's subjectAltName.
    ``decryptor`` names the site that gets ``role = "decryptor"`` (CKKS mode, docs/protocol.md §4.3).
    ``round_settings`` overrides keys of server.toml's [round] table
    (:func:`afl.server.config.round_template`: classes, feature_dim, gram_scope, ...).
    Every kit's [policy] allows ``mask`` and ``ckks`` only, plus ``plaintext`` with
    ``allow_plaintext`` (development; the sites opt in to sending statistics in the clear), pins
    ``decryptor`` as its CKKS decryptor, and discloses coverage only in a per-class federation.

    Raises:
        ProvisioningError: bad arguments, or ``out_dir`` already holds a federation (ca.pem,
            ca.key or federation.toml) and ``force`` is false.
        afl.crypto.pki.PkiError: an invalid site id or host name.
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
    primary_host = server_hosts[0]
    all_hosts = [*server_hosts, *(h for h in ("localhost", "127.0.0.1") if h not in server_hosts)]
    server_address = _address(primary_host, port)
    listen = _address("127.0.0.1" if primary_host in _LOOPBACK_NAMES else "0.0.0.0", port)

    ca = pki.create_ca(common_name=f"afl federation CA {fed_id}", valid_days=max(valid_days, 3650))
    server_tls = pki.issue_server_certificate(
        ca, common_name=primary_host, hosts=all_hosts, valid_days=valid_days
    )
    server_identity = signatures.generate_identity_key()
    server_public = signatures.public_key_to_raw(server_identity)
    site_identities = {s: signatures.generate_identity_key() for s in site_ids}
    peers = {s: signatures.public_key_to_raw(k) for s, k in sorted(site_identities.items())}
    roles = {s: ("decryptor" if s == decryptor else "participant") for s in site_ids}

    if not root.exists():
        _mkdir_private(root)
    ca_pem = ca.certificate_pem()
    pki.write_private_file(root / "ca.key", ca.private_key_pem())
    _write_public(root / "ca.pem", ca_pem)

    server_dir = _mkdir_private(root / "server")
    _write_public(server_dir / "ca.pem", ca_pem)
    _write_public(server_dir / "server.pem", server_tls.certificate_pem())
    pki.write_private_file(server_dir / "server.key", server_tls.private_key_pem())
    pki.write_private_file(
        server_dir / "identity.key", signatures.private_key_to_pem(server_identity)
    )
    server_text = _server_toml(
        federation_id=fed_id,
        listen=listen,
        server_public=server_public,
        peers=peers,
        roles=roles,
        round_settings=round_settings,
    )
    _write_public(server_dir / "server.toml", server_text.encode())

    site_policy = _site_policy(
        decryptor=decryptor,
        allow_plaintext=allow_plaintext,
        gram_scope=round_template(round_settings)["gram_scope"],
    )
    site_dirs: dict[str, Path] = {}
    for site_id in site_ids:
        _mkdir_private(root / "sites")
        kit = _mkdir_private(root / "sites" / site_id)
        site_tls = pki.issue_site_certificate(ca, site_id=site_id, valid_days=valid_days)
        _write_public(kit / "ca.pem", ca_pem)
        _write_public(kit / "site.pem", site_tls.certificate_pem())
        pki.write_private_file(kit / "site.key", site_tls.private_key_pem())
        identity_pem = signatures.private_key_to_pem(site_identities[site_id])
        pki.write_private_file(kit / "identity.key", identity_pem)
        client_text = _client_toml(
            site_id=site_id,
            federation_id=fed_id,
            server_address=server_address,
            role=roles[site_id],
            site_public=peers[site_id],
            server_public=server_public,
            peers=peers,
            policy=site_policy,
        )
        _write_public(kit / "client.toml", client_text.encode())
        site_dirs[site_id] = kit

    federation: dict[str, toml_text.TomlValue] = {
        "federation": {
            "federation_id": fed_id,
            "server_address": server_address,
            "server_identity_public_key": server_public.hex(),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        },
        "sites": {s: {"identity_public_key": peers[s].hex(), "role": roles[s]} for s in site_ids},
    }
    _write_public(
        root / "federation.toml",
        toml_text.dumps(
            federation, header="Federation manifest, written by `afl provision`."
        ).encode(),
    )
    return ProvisionedFederation(
        root=root,
        federation_id=fed_id,
        server_address=server_address,
        ca_cert=root / "ca.pem",
        server_dir=server_dir,
        site_dirs=site_dirs,
    )
