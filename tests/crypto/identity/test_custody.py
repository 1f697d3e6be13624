"""afl.crypto.identity.custody (docs/protocol.md §1, M-71): key requests and rosters — what the operator
accepts from a site, and what the site accepts from the operator."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.identity import custody, pki, signatures


@pytest.fixture(scope="module")
def site() -> tuple[custody.PrivateKeys, custody.KeyRequest]:
    return custody.new_site_request(site_id="hospital-a")


def _resigned(request: custody.KeyRequest, keys: custody.PrivateKeys, **changes: Any) -> Any:
    """``request`` with ``changes`` and a proof by ``keys``' identity key over them (what a site,
    honest or not, can always produce)."""
    changed = dataclasses.replace(request, **changes, identity_proof=b"")
    proof = signatures.sign(keys.identity_key, changed.signed_message())
    return dataclasses.replace(changed, identity_proof=proof)


def _csr(key: Any, *, common_name: str, san: list[x509.GeneralName], ca: bool = False) -> bytes:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    return pki.csr_to_pem(builder.sign(key, hashes.SHA256()))


def test_site_request_round_trips_and_verifies(site: Any) -> None:
    keys, request = site
    parsed = custody.request_from_json(request.to_json())
    assert parsed == request
    public = parsed.verify()
    assert public == keys.tls_key.public_key()
    assert parsed.identity_public_key == signatures.public_key_to_raw(keys.identity_key)
    document = json.loads(request.to_json())
    assert "PRIVATE" not in request.to_json() and document["fingerprint"] == request.fingerprint
    assert len(request.fingerprint.replace(" ", "")) == 32
    assert repr(keys) == "PrivateKeys(<redacted>)"


def test_server_request_names_its_hosts() -> None:
    keys, request = custody.new_server_request(hosts=["afl.example.org", "127.0.0.1"], port=6000)
    parsed = custody.request_from_json(request.to_json())
    assert (parsed.kind, parsed.name, parsed.hosts, parsed.port) == (
        "server",
        "afl.example.org",
        ("afl.example.org", "127.0.0.1"),
        6000,
    )
    assert parsed.verify() == keys.tls_key.public_key()
    with pytest.raises(custody.CustodyError, match="names"):  # a CSR for more hosts than stated
        dataclasses.replace(parsed, hosts=("afl.example.org",), name="afl.example.org").verify()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "hospital-b"}, "does not verify|subject"),
        ({"role": "decryptor"}, "does not verify"),
        ({"identity_public_key": b"\x01" * 32}, "public key|does not verify"),
    ],
)
def test_tampered_request_is_refused(site: Any, change: dict[str, Any], message: str) -> None:
    _, request = site
    with pytest.raises(custody.CustodyError, match=message):
        dataclasses.replace(request, **change).verify()


def test_swapped_csr_or_stated_fingerprint_is_refused(site: Any) -> None:
    _, request = site
    _, other = custody.new_site_request(site_id="hospital-a")
    with pytest.raises(custody.CustodyError, match="does not verify"):
        dataclasses.replace(request, csr_pem=other.csr_pem).verify()
    document = json.loads(request.to_json())
    document["fingerprint"] = other.fingerprint
    with pytest.raises(custody.CustodyError, match="fingerprint"):
        custody.request_from_json(json.dumps(document))


def test_csr_for_another_site_is_refused(site: Any) -> None:
    keys, request = site
    csr = pki.csr_to_pem(pki.site_csr(keys.tls_key, site_id="hospital-b"))
    forged = _resigned(request, keys, csr_pem=csr)  # a valid proof over the wrong CSR
    with pytest.raises(custody.CustodyError, match="subject"):
        forged.verify()


@pytest.mark.parametrize(
    "key",
    [
        ec.generate_private_key(ec.SECP384R1()),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
    ],
    ids=["p384", "rsa"],
)
def test_csr_with_another_key_type_is_refused(site: Any, key: Any) -> None:
    keys, request = site
    uri = x509.UniformResourceIdentifier("afl-site:hospital-a")
    forged = _resigned(request, keys, csr_pem=_csr(key, common_name="hospital-a", san=[uri]))
    with pytest.raises(custody.CustodyError, match="P-256"):
        forged.verify()


def test_csr_asking_for_ca_powers_is_refused(site: Any) -> None:
    keys, request = site
    uri = x509.UniformResourceIdentifier("afl-site:hospital-a")
    csr = _csr(keys.tls_key, common_name="hospital-a", san=[uri], ca=True)
    with pytest.raises(custody.CustodyError, match="other extensions"):
        _resigned(request, keys, csr_pem=csr).verify()


@pytest.mark.parametrize(
    "text", ["not json", "[]", json.dumps({"format": "afl-key-request/1", "kind": "site"})]
)
def test_malformed_request_files_are_refused(text: str) -> None:
    with pytest.raises(custody.CustodyError):
        custody.request_from_json(text)


def _roster() -> custody.Roster:
    ca = pki.create_ca(common_name="roster CA")
    return custody.Roster(
        federation_id="fed-r",
        server_address="afl.example.org:50051",
        ca_certificate_pem=ca.certificate_pem(),
        server_identity_public_key=b"\x05" * 32,
        sites={
            "a": custody.RosterSite(b"\x0a" * 32, "participant"),
            "b": custody.RosterSite(b"\x0b" * 32, "decryptor"),
        },
    )


ROSTER = _roster()


def test_roster_round_trips_and_a_changed_roster_is_refused() -> None:
    assert custody.roster_from_json(ROSTER.to_json()) == ROSTER
    document = json.loads(ROSTER.to_json())
    document["sites"]["a"]["identity_public_key"] = "0c" * 32  # the fingerprint stays the old one
    with pytest.raises(custody.CustodyError, match="fingerprint"):
        custody.roster_from_json(json.dumps(document))
    del document["fingerprint"]  # without one, the roster parses; its fingerprint differs
    assert custody.roster_from_json(json.dumps(document)).fingerprint != ROSTER.fingerprint


@pytest.mark.parametrize(
    "change",
    [
        {"sites": {"a": {"identity_public_key": "0a" * 32, "role": "server"}}},
        {"sites": {"Bad Id": {"identity_public_key": "0a" * 32, "role": "participant"}}},
        {"server_identity_public_key": "05" * 31},
        {"ca_certificate": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"},
        {"federation_id": ""},
        {"format": "afl-roster/0"},
    ],
)
def test_malformed_rosters_are_refused(change: dict[str, Any]) -> None:
    document = {**json.loads(ROSTER.to_json()), **change}
    document.pop("fingerprint")
    with pytest.raises(custody.CustodyError):
        custody.roster_from_json(json.dumps(document))


_SITE_IDS = st.sampled_from(["a", "b", "c"])


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["federation_id", "server_address", "server", "site_key", "site_role"]),
    site_id=_SITE_IDS,
)
def test_property_every_roster_field_changes_the_fingerprint(field: str, site_id: str) -> None:
    """Any single change a substitution could make (federation, address, the server's or a site's
    key or role, a site added) gives another fingerprint."""
    sites = dict(ROSTER.sites)
    entry = sites.get(site_id, custody.RosterSite(b"\x0c" * 32, "participant"))
    if field == "site_key":
        sites[site_id] = dataclasses.replace(entry, identity_public_key=b"\x0d" * 32)
    elif field == "site_role":
        role = "participant" if entry.role == "decryptor" else "decryptor"
        sites[site_id] = dataclasses.replace(entry, role=role)
    changes: dict[str, dict[str, Any]] = {
        "federation_id": {"federation_id": "fed-s"},
        "server_address": {"server_address": "evil.example.org:50051"},
        "server": {"server_identity_public_key": b"\x06" * 32},
    }
    changed = changes.get(field, {"sites": sites})
    assert dataclasses.replace(ROSTER, **changed).fingerprint != ROSTER.fingerprint


def test_another_ca_changes_the_fingerprint() -> None:
    other = pki.create_ca(common_name="roster CA").certificate_pem()
    assert dataclasses.replace(ROSTER, ca_certificate_pem=other).fingerprint != ROSTER.fingerprint
