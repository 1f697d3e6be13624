"""afl.client.kit, `afl-client init` (docs/protocol.md §1, M-70, M-72): the site makes its keys in its
kit folder and installs only a bundle that checks out against its own keys, the roster and the
roster fingerprint the operator published."""

from __future__ import annotations

import json
import math
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from afl.client.cli import main as client_main
from afl.client.config import load_client_config
from afl.client.doctor import _policy as _policy_findings
from afl.client.kit import KitError, import_bundle, init_site_kit
from afl.client.policy.defaults import permissive_settings
from afl.crypto.identity import custody, pki, signatures
from afl.crypto.identity.kit_check import OK, WARNING
from afl.ops.provisioning import SignedFederation, init_ca, init_server_kit, sign_requests
from afl.server import toml_text


@dataclass(frozen=True)
class Setup:
    kit: Path
    signed: SignedFederation
    tmp: Path

    @property
    def bundle(self) -> Path:
        return self.signed.site_dirs["h1"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sign(tmp: Path, ca_name: str, requests: list[Path]) -> SignedFederation:
    ca_dir, _ = init_ca(tmp / ca_name, federation_id="fed-kit", passphrase=None)
    return sign_requests(ca_dir, requests, tmp / f"{ca_name}-out", passphrase=None)


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    kit = tmp_path / "h1-kit"
    request, _ = init_site_kit(kit, site_id="h1")
    other, _ = init_site_kit(tmp_path / "h2-kit", site_id="h2", role="decryptor")
    server, _ = init_server_kit(tmp_path / "server-kit", hosts=["localhost"], port=6001)
    return Setup(kit, _sign(tmp_path, "ca", [server, request, other]), tmp_path)


def test_init_keeps_the_keys_in_the_kit_and_never_overwrites_them(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    path, request = init_site_kit(kit, site_id="hospital-a")
    assert _mode(kit) == 0o700
    assert _mode(kit / "site.key") == 0o600 and _mode(kit / "identity.key") == 0o600
    assert path == kit / "hospital-a.request.json" and _mode(path) == 0o644
    assert custody.request_from_json(path.read_text()) == request
    tls = pki.load_tls_private_key_pem((kit / "site.key").read_bytes())
    identity = signatures.load_private_key_pem((kit / "identity.key").read_bytes())
    assert request.verify() == tls.public_key()
    assert request.identity_public_key == signatures.public_key_to_raw(identity)
    assert b"PRIVATE KEY" not in path.read_bytes()
    before = (kit / "identity.key").read_bytes()
    with pytest.raises(KitError, match="already holds"):
        init_site_kit(kit, site_id="hospital-a")
    assert (kit / "identity.key").read_bytes() == before
    with pytest.raises(KitError, match="invalid site id"):
        init_site_kit(tmp_path / "bad", site_id="Bad Id")


def test_import_installs_a_bundle_that_checks_out(setup: Setup) -> None:
    roster = setup.signed.roster
    imported = import_bundle(setup.kit, setup.bundle, roster_fingerprint=roster.fingerprint)
    assert imported.config == setup.kit / "client.toml" and not imported.config_is_new
    config = load_client_config(setup.kit / "client.toml")
    assert config.site_id == "h1" and config.federation_id == "fed-kit"
    assert config.server_address == "localhost:6001"
    assert dict(config.peers) == roster.identity_keys() and set(config.peers) == {"h1", "h2"}
    assert config.server_public_key == roster.server_identity_public_key
    assert not (setup.kit / ".client.toml.import").exists()
    # The site edits its config; a later import keeps it and offers the template beside it.
    (setup.kit / "client.toml").write_text(
        (setup.kit / "client.toml").read_text().replace("min_cohort = 3", "min_cohort = 5")
    )
    again = import_bundle(setup.kit, setup.bundle)
    assert again.config == setup.kit / "client.toml.new" and again.config_is_new
    assert load_client_config(setup.kit / "client.toml").policy.min_cohort == 5


def test_a_production_kit_gets_the_protective_policy_and_doctor_shows_it(setup: Setup) -> None:
    """M-171, M-172: the imported client.toml carries an explicit [policy] with the protective
    values (parsed from the file, then as the daemon loads it); doctor prints the effective
    policy and names each value made permissive."""
    import_bundle(setup.kit, setup.bundle, roster_fingerprint=setup.signed.roster.fingerprint)
    path = setup.kit / "client.toml"
    written = tomllib.loads(path.read_text())["policy"]
    assert written["profile"] == "production"
    assert written["allowed_aggregation"] == ["mask", "ckks"]
    assert written["ckks_decryptor"] == "h2"  # the roster's decryptor, pinned
    assert written["disclose_row_bounds"] is False and written["allow_exposure"] is False
    assert 0 < written["max_epsilon"] <= written["lifetime_epsilon"] < math.inf
    assert written["min_cohort"] >= 3 and written["privacy_unit"] == "patient"
    policy = load_client_config(path).policy
    assert math.isfinite(policy.lifetime_epsilon) and not policy.disclose_row_bounds
    assert permissive_settings(policy) == []
    (summary,) = [f.message for f in _policy_findings(load_client_config(path))]
    assert summary.startswith("policy (production): modes ['mask', 'ckks'], decryptor h2")
    assert "lifetime_epsilon 10" in summary and "disclose_row_bounds false" in summary
    # Made permissive by hand: doctor names each loosened value in one WARNING.
    loose = path.read_text().replace("lifetime_epsilon = 10", "lifetime_epsilon = inf")
    path.write_text(loose.replace('["mask", "ckks"]', '["plaintext", "mask"]'))
    findings = _policy_findings(load_client_config(path))
    assert [f.level for f in findings] == [OK, WARNING]
    assert "lifetime_epsilon = inf" in findings[1].message
    assert "includes plaintext" in findings[1].message


def test_a_roster_other_than_the_published_one_is_refused(setup: Setup) -> None:
    with pytest.raises(KitError, match="fingerprint"):
        import_bundle(setup.kit, setup.bundle, roster_fingerprint="00" * 16)
    assert not (setup.kit / "client.toml").exists()


def _rewrite_roster(bundle: Path, **sites: custody.RosterSite) -> None:
    """The operator changes the roster and states a matching fingerprint."""
    roster = custody.roster_from_json((bundle / "roster.json").read_text())
    changed = custody.Roster(**{**roster.__dict__, "sites": {**roster.sites, **sites}})
    (bundle / "roster.json").write_text(changed.to_json())


def test_a_roster_with_another_identity_key_for_this_site_is_refused(setup: Setup) -> None:
    operators_key = signatures.public_key_to_raw(signatures.generate_identity_key())
    _rewrite_roster(setup.bundle, h1=custody.RosterSite(operators_key, "participant"))
    with pytest.raises(KitError, match="another identity key"):
        import_bundle(setup.kit, setup.bundle)
    own = custody.request_from_json((setup.kit / "h1.request.json").read_text())
    _rewrite_roster(setup.bundle, h1=custody.RosterSite(own.identity_public_key, "decryptor"))
    with pytest.raises(KitError, match="lists this site as decryptor"):
        import_bundle(setup.kit, setup.bundle)


def test_a_certificate_from_another_ca_is_refused(setup: Setup) -> None:
    request = setup.kit / "h1.request.json"
    server, _ = init_server_kit(setup.tmp / "rogue-server", hosts=["localhost"], port=6001)
    rogue = _sign(setup.tmp, "rogue-ca", [server, request])  # the request is public
    # The rogue certificate alone, next to the federation's CA and roster.
    (setup.bundle / "site.pem").write_bytes((rogue.site_dirs["h1"] / "site.pem").read_bytes())
    with pytest.raises(KitError, match="not issued by this federation's CA"):
        import_bundle(setup.kit, setup.bundle)
    # A whole rogue bundle is consistent in itself: only the published fingerprint catches it.
    published = setup.signed.roster.fingerprint
    with pytest.raises(KitError, match="fingerprint"):
        import_bundle(setup.kit, rogue.site_dirs["h1"], roster_fingerprint=published)


def test_a_certificate_for_another_key_or_site_is_refused(setup: Setup) -> None:
    ca = pki.CertifiedKey(
        certificate=pki.load_certificate_pem((setup.tmp / "ca" / "ca.pem").read_bytes()),
        private_key=pki.load_tls_private_key_pem((setup.tmp / "ca" / "ca.key").read_bytes()),
    )
    operators = pki.issue_site_certificate(ca, site_id="h1")  # the operator's own key, h1's name
    (setup.bundle / "site.pem").write_bytes(operators.certificate_pem())
    with pytest.raises(KitError, match="certifies another key"):
        import_bundle(setup.kit, setup.bundle)
    with pytest.raises(KitError, match="names site 'h2'"):
        import_bundle(setup.kit, setup.signed.site_dirs["h2"])


def _edit_template(bundle: Path, table: str, key: str, value: Any) -> None:
    document = tomllib.loads((bundle / "client.toml").read_text())
    document.setdefault(table, {})[key] = value
    (bundle / "client.toml").write_text(toml_text.dumps(document))


@pytest.mark.parametrize(
    ("table", "key", "value", "message"),
    [
        ("policy", "min_cohort", 1, r"\[policy\]"),
        ("peers", "h2", "07" * 32, "peers differs"),
        ("identity", "server_public_key", "07" * 32, "server_public_key differs"),
        ("client", "server", "evil.example.org:6001", "server_address differs"),
        ("client", "federation_id", "fed-other", "federation_id differs"),
        ("tls", "ca_cert", "../h2-kit/site.pem", "does not exist|tls differs"),
        ("client", "state_dir", "../elsewhere", "outside the kit"),
        ("client", "unexpected", 1, "unknown key"),
    ],
)
def test_a_template_that_disagrees_with_the_roster_or_the_kit_is_refused(
    setup: Setup, table: str, key: str, value: Any, message: str
) -> None:
    _edit_template(setup.bundle, table, key, value)
    with pytest.raises(KitError, match=message):
        import_bundle(setup.kit, setup.bundle)
    assert not (setup.kit / "client.toml").exists()
    assert not (setup.kit / ".client.toml.import").exists()


def test_cli_init_then_import(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kit = tmp_path / "cli-kit"
    assert client_main(["init", "--kit", str(kit), "--site-id", "h9"]) == 0
    out = capsys.readouterr().out
    request = custody.request_from_json((kit / "h9.request.json").read_text())
    assert request.fingerprint in out
    assert client_main(["init", "--kit", str(kit), "--site-id", "h9"]) == 1
    assert "already holds" in capsys.readouterr().err
    fingerprint = setup.signed.roster.fingerprint
    argv = ["init", "--kit", str(setup.kit), "--import", str(setup.bundle)]
    assert client_main(argv) == 1  # no fingerprint: nothing compared, nothing installed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--roster-fingerprint is required" in err
    assert not (setup.kit / "roster.json").exists()
    assert client_main([*argv, "--roster-fingerprint", "ab" * 16]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "do not use this bundle" in err
    assert client_main([*argv, "--roster-fingerprint", fingerprint]) == 0
    assert f"{fingerprint}  (matches)" in capsys.readouterr().out
    assert json.loads((setup.kit / "roster.json").read_text())["fingerprint"] == fingerprint


def test_an_unverified_roster_is_imported_only_on_request_and_said_so(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["init", "--kit", str(setup.kit), "--import", str(setup.bundle)]
    assert client_main([*argv, "--unverified-roster"]) == 0
    assert "NOT CHECKED" in capsys.readouterr().out
