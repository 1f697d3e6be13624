"""The site's startup kit made at the site (``afl-client init``; docs/operations.md §2,
docs/protocol.md §1, M-70, M-72): the site's private keys are generated here and never leave the
kit folder; the operator only ever sees the public request, and sends back public material.

Step 1, :func:`init_site_kit`: in the kit folder (0700) ``site.key`` (ECDSA P-256 TLS key) and
``identity.key`` (Ed25519), both 0600, and the public ``<site id>.request.json`` (the certificate
signing request, the identity public key and a proof binding them; :mod:`afl.crypto.identity.custody`).
Site IT sends the request to the operator and reads its fingerprint to them out of band.

Step 2, :func:`import_bundle`: the operator's folder for this site (``ca.pem``, ``site.pem``,
``roster.json``, ``client.toml``) is checked before anything is trusted:

* the roster's stated fingerprint matches its contents, and equals the fingerprint the operator
  published out of band when one is given (``--roster-fingerprint``);
* the roster lists this site with this kit's identity key and role, and the bundle's ``ca.pem`` is
  the roster's CA;
* ``site.pem`` is issued by that CA, names this site and certifies this kit's own TLS key;
* the ``client.toml`` template carries no [policy] (the site's policy is its own) and, loaded by
  the daemon's own loader, every value that decides whom the site trusts (federation, server
  address and identity key, peers, its own keys and certificate paths, role) equals the roster's
  and the kit's; a template naming a setting this check does not know is refused.

Then ``ca.pem``, ``site.pem``, ``roster.json`` and ``client.toml`` are written into the kit (an
existing ``client.toml`` is kept, and the template goes to ``client.toml.new``). A new
``client.toml`` is the template plus the site's own production ``[policy]``
(:func:`afl.client.policy.defaults.production_policy_toml`: protective values, the roster's
decryptor pinned), written by this software, not by the operator.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from afl.client.config import ClientConfig, ConfigError, TlsPaths, load_client_config
from afl.client.policy.defaults import production_policy_toml
from afl.crypto.errors import CryptoError
from afl.crypto.identity import custody, pki, signatures
from afl.crypto.identity.revocation import CRL_NAME, load_crl

__all__ = ["ImportedKit", "KitError", "import_bundle", "init_site_kit", "request_path"]

ROSTER = "roster.json"
_KEYS = ("site.key", "identity.key")
_BUNDLE = ("ca.pem", "site.pem", ROSTER, "client.toml")
# ClientConfig fields the site owns (set by its IT after import) and the fields the import checks.
_SITE_OWNED = {
    "path",
    "state_dir",
    "data",
    "policy",
    "timing",
    "serve",
    "ckks_draw_ahead",
    "warnings",
    "retention",
}
_CHECKED = {
    "site_id",
    "federation_id",
    "server_address",
    "role",
    "tls",
    "identity_key_path",
    "identity_public_key",
    "server_public_key",
    "peers",
}


class KitError(ValueError):
    """The kit cannot be initialised or the bundle is refused (the message names the file)."""


def request_path(kit: Path, site_id: str) -> Path:
    """Where :func:`init_site_kit` writes the site's request."""
    return kit / f"{site_id}.request.json"


def _write_public(path: Path, data: bytes) -> None:
    pki.write_private_file(path, data, mode=0o644)


def init_site_kit(
    kit_dir: str | os.PathLike[str], *, site_id: str, role: str = "participant"
) -> tuple[Path, custody.KeyRequest]:
    """Generate this site's keys in ``kit_dir`` and write its public request (module docstring);
    returns (request path, request). :class:`KitError` if the kit already holds keys (they are
    never overwritten) or the site id or role is invalid."""
    kit = Path(kit_dir)
    existing = [name for name in _KEYS if (kit / name).exists()]
    if existing:
        raise KitError(
            f"{kit} already holds {', '.join(existing)}: this site is initialised (send its "
            f"request again, or move the keys away to make new ones)"
        )
    try:
        keys, request = custody.new_site_request(site_id=site_id, role=role)
    except CryptoError as exc:
        raise KitError(str(exc)) from exc
    kit.mkdir(parents=True, exist_ok=True)
    os.chmod(kit, 0o700)
    pki.write_private_file(kit / "site.key", keys.tls_pem())
    pki.write_private_file(kit / "identity.key", keys.identity_pem())
    path = request_path(kit, site_id)
    _write_public(path, request.to_json().encode())
    return path, request


@dataclass(frozen=True)
class ImportedKit:
    """What :func:`import_bundle` installed."""

    roster: custody.Roster
    request: custody.KeyRequest
    config: Path
    config_is_new: bool


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KitError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _own_request(kit: Path) -> custody.KeyRequest:
    """The kit's request, checked against the kit's own private keys."""
    found = sorted(kit.glob("*.request.json"))
    if len(found) != 1:
        raise KitError(f"{kit} must hold exactly one <site id>.request.json from `afl-client init`")
    try:
        request = custody.request_from_json(_read(found[0]).decode("utf-8"))
        tls_key = pki.load_tls_private_key_pem(_read(kit / "site.key"))
        identity = signatures.load_private_key_pem(_read(kit / "identity.key"))
    except (CryptoError, UnicodeDecodeError) as exc:
        raise KitError(f"{kit}: {exc}") from exc
    if request.kind != "site" or request_path(kit, request.name) != found[0]:
        raise KitError(f"{found[0]} is not this kit's site request")
    csr_key = pki.load_csr_pem(request.csr_pem).public_key()
    if csr_key != tls_key.public_key():
        raise KitError(f"{found[0]} does not hold the public key of {kit / 'site.key'}")
    if signatures.public_key_to_raw(identity) != request.identity_public_key:
        raise KitError(f"{found[0]} does not hold the public key of {kit / 'identity.key'}")
    return request


def _check_roster(
    roster: custody.Roster, request: custody.KeyRequest, expected_fingerprint: str | None
) -> None:
    if expected_fingerprint is not None:
        given = "".join(expected_fingerprint.split()).lower()
        if given != "".join(roster.fingerprint.split()):
            raise KitError(
                f"the roster's fingerprint is {roster.fingerprint}, not the {expected_fingerprint} "
                "the operator published: do not use this bundle"
            )
    entry = roster.sites.get(request.name)
    if entry is None:
        raise KitError(f"the roster does not list this site {request.name!r}")
    if entry.identity_public_key != request.identity_public_key:
        raise KitError(
            f"the roster lists another identity key for this site {request.name!r} than the one "
            "in its request"
        )
    if entry.role != request.role:
        raise KitError(f"the roster lists this site as {entry.role}, its request as {request.role}")


def _check_certificate(bundle: Path, roster: custody.Roster, request: custody.KeyRequest) -> None:
    try:
        ca = pki.load_certificate_pem(_read(bundle / "ca.pem"))
        roster_ca = pki.load_certificate_pem(roster.ca_certificate_pem)
        certificate = pki.load_certificate_pem(_read(bundle / "site.pem"))
    except pki.PkiError as exc:
        raise KitError(f"{bundle}: {exc}") from exc
    if ca != roster_ca:
        raise KitError(f"{bundle / 'ca.pem'} is not the CA the roster names")
    try:
        pki.verify_issued_by(certificate, ca)
        named = pki.site_id_from_certificate(certificate)
    except pki.PkiError as exc:
        raise KitError(f"{bundle / 'site.pem'}: {exc}") from exc
    if named != request.name:
        raise KitError(f"{bundle / 'site.pem'} names site {named!r}, not {request.name!r}")
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    csr_key = pki.load_csr_pem(request.csr_pem).public_key()
    if certificate.public_key().public_bytes(der, spki) != csr_key.public_bytes(der, spki):
        raise KitError(f"{bundle / 'site.pem'} certifies another key than this kit's site.key")


def _check_template(
    config: ClientConfig, kit: Path, roster: custody.Roster, request: custody.KeyRequest
) -> None:
    unknown = {f.name for f in dataclasses.fields(config)} - _SITE_OWNED - _CHECKED
    if unknown:  # fail closed: a new client.toml setting needs its check here first
        raise KitError(f"client.toml template: no import check for {', '.join(sorted(unknown))}")
    if config.warnings:
        raise KitError(f"client.toml template: {config.warnings[0]}")
    root = kit.resolve()
    expected: dict[str, object] = {
        "site_id": request.name,
        "federation_id": roster.federation_id,
        "server_address": roster.server_address,
        "role": request.role,
        "tls": TlsPaths(
            root / "ca.pem",
            root / "site.pem",
            root / "site.key",
            root / CRL_NAME if config.tls.crl is not None else None,
        ),
        "identity_key_path": root / "identity.key",
        "identity_public_key": request.identity_public_key,
        "server_public_key": roster.server_identity_public_key,
        "peers": roster.identity_keys(),
    }
    for name, value in expected.items():
        actual = getattr(config, name)
        if (dict(actual) if name == "peers" else actual) != value:
            raise KitError(f"client.toml template: {name} differs from the roster and this kit")
    if not config.state_dir.resolve().is_relative_to(root):
        raise KitError("client.toml template: state_dir lies outside the kit folder")


def import_bundle(
    kit_dir: str | os.PathLike[str],
    bundle_dir: str | os.PathLike[str],
    *,
    roster_fingerprint: str | None = None,
) -> ImportedKit:
    """Check the operator's bundle for this kit and install it (module docstring).

    Raises:
        KitError: the kit or the bundle is incomplete, or a check fails (the message says which).
    """
    kit, bundle = Path(kit_dir), Path(bundle_dir)
    request = _own_request(kit)
    missing = [name for name in _BUNDLE if not (bundle / name).is_file()]
    if missing:
        raise KitError(f"{bundle} lacks {', '.join(missing)} (the operator's `afl ca sign` output)")
    roster_bytes = _read(bundle / ROSTER)
    try:
        roster = custody.roster_from_json(roster_bytes.decode("utf-8"))
    except (custody.CustodyError, UnicodeDecodeError) as exc:
        raise KitError(f"{bundle / ROSTER}: {exc}") from exc
    _check_roster(roster, request, roster_fingerprint)
    _check_certificate(bundle, roster, request)
    template = _read(bundle / "client.toml")
    try:
        if "policy" in tomllib.loads(template.decode("utf-8")):
            raise KitError(
                "client.toml template sets [policy]: a site's policy is its own (add it after "
                "the import)"
            )
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KitError(f"{bundle / 'client.toml'}: not TOML ({exc})") from exc

    for name in ("ca.pem", "site.pem"):  # checked above; the loader needs them in place
        _write_public(kit / name, _read(bundle / name))
    if (bundle / CRL_NAME).is_file():  # the CA's revocation list: only one the CA signed
        crl_pem = _read(bundle / CRL_NAME)
        try:
            load_crl(crl_pem, ca_certificate=pki.load_certificate_pem(roster.ca_certificate_pem))
        except pki.PkiError as exc:
            raise KitError(f"{bundle / CRL_NAME}: {exc}") from exc
        _write_public(kit / CRL_NAME, crl_pem)
    staged = kit / ".client.toml.import"
    _write_public(staged, template)
    try:
        try:
            config = load_client_config(staged)
        except ConfigError as exc:
            raise KitError(f"client.toml template: {exc}") from exc
        _check_template(config, kit, roster, request)
    except KitError:
        staged.unlink(missing_ok=True)
        raise
    # A new client.toml gets the site's own protective [policy] (M-171), written here by the
    # site's software, never taken from the operator's template.
    decryptors = sorted(s for s, e in roster.sites.items() if e.role == "decryptor")
    policy = production_policy_toml(ckks_decryptor=decryptors[0] if decryptors else None)
    installed = template + policy.encode()
    target = kit / "client.toml"
    if target.exists() and target.read_bytes() != installed:
        target = kit / "client.toml.new"  # keep the site's own [data] and [policy]
    else:
        _write_public(staged, installed)
    staged.replace(target)
    _write_public(kit / ROSTER, roster_bytes)
    return ImportedKit(roster, request, target, target.name != "client.toml")
