"""client.toml loading (afl.client.config): the provisioned kit loads, bad values fail clearly."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from afl.client.config import ConfigError, LocalPolicy, load_client_config
from afl.ops.provisioning import ProvisionedFederation
from tests.helpers.federation import FederationSpec, rewrite_client_toml

FEDERATION = FederationSpec(sites=["site-a", "site-b"], port=50999)


@pytest.fixture(scope="module")
def kit(federation: ProvisionedFederation) -> Path:
    return federation.site_dirs["site-a"]


_rewrite = rewrite_client_toml


def test_provisioned_kit_loads_with_defaults(kit: Path) -> None:
    cfg = load_client_config(kit / "client.toml")
    assert cfg.site_id == "site-a"
    assert cfg.server_address == "localhost:50999"
    assert cfg.policy == LocalPolicy(
        min_cohort=3, allow_exposure=False, max_epsilon=math.inf, profile="development"
    )
    assert cfg.data.cache == kit / "cache"  # provisioning writes the documented key, cache
    assert cfg.data.classes == ()
    assert cfg.state_dir == kit / "state"
    assert set(cfg.peers) == {"site-a", "site-b"}
    assert cfg.tls.cert.name == "site.pem"
    assert len(cfg.server_public_key) == 32
    assert cfg.ckks_draw_ahead and not cfg.serve  # M-237: drawn ahead unless switched off


def test_drawing_ahead_is_switched_off_in_client_and_must_be_a_boolean(
    kit: Path, tmp_path: Path
) -> None:
    off = _rewrite(kit, tmp_path, client={"ckks_draw_ahead": False})
    assert load_client_config(off).ckks_draw_ahead is False
    with pytest.raises(ConfigError, match="ckks_draw_ahead"):
        load_client_config(_rewrite(kit, tmp_path, client={"ckks_draw_ahead": "no"}))


def test_data_and_policy_extensions(kit: Path, tmp_path: Path) -> None:
    path = _rewrite(
        kit,
        tmp_path,
        data={"cache_dir": None, "cache": "/data/feats", "classes": ["A", "B"], "backbone": "x"},
        policy={
            "min_cohort": 5, "allow_exposure": True, "max_epsilon": 2.5,
            "lifetime_epsilon": 8.0, "lifetime_delta": 1e-6, "privacy_unit": "image",
        },
    )  # fmt: skip
    cfg = load_client_config(path)
    assert cfg.data.cache == Path("/data/feats")
    assert cfg.data.classes == ("A", "B")
    assert cfg.data.backbone == "x"
    assert cfg.policy == LocalPolicy(
        min_cohort=5, allow_exposure=True, max_epsilon=2.5, lifetime_epsilon=8.0,
        lifetime_delta=1e-6, privacy_unit="image", disclose_row_bounds=False,
        profile="development",
    )  # fmt: skip


def test_row_bounds_leave_a_site_only_outside_dp_and_where_a_mode_needs_them(
    kit: Path, tmp_path: Path
) -> None:
    """docs/protocol.md [M-127]: the declared row count and norm are a release outside any DP
    budget: a DP-requiring policy never sends them (and refuses to be told to), plaintext-only
    sites need none, mask/ckks sites without DP send them unless they opt out."""

    def declared(**policy: object) -> bool:
        return load_client_config(_rewrite(kit, tmp_path, policy=policy)).policy.disclose_row_bounds

    assert declared(disclose_row_bounds=None) is True  # mask and ckks, no DP: sized by them
    assert declared(disclose_row_bounds=None, max_epsilon=4.0) is False
    assert declared(disclose_row_bounds=None, lifetime_epsilon=10.0) is False
    assert declared(disclose_row_bounds=None, allowed_aggregation=["plaintext"]) is False
    assert declared(disclose_row_bounds=False) is False
    with pytest.raises(ConfigError, match="disclose_row_bounds: must be false when max_epsilon"):
        declared(disclose_row_bounds=True, max_epsilon=4.0)


def test_the_dp_colluder_floor_is_a_fraction_of_the_members(kit: Path, tmp_path: Path) -> None:
    path = _rewrite(kit, tmp_path, policy={"dp_assumed_colluders": 0.5})
    assert load_client_config(path).policy.dp_assumed_colluders == 0.5
    with pytest.raises(ConfigError, match="dp_assumed_colluders: must lie in"):
        load_client_config(_rewrite(kit, tmp_path, policy={"dp_assumed_colluders": 1.0}))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"policy": {"min_cohort": 0}}, "min_cohort: must be >= 1"),
        ({"policy": {"min_cohort": "3"}}, "min_cohort: must be an integer"),
        ({"policy": {"allow_exposure": "no"}}, "allow_exposure: must be true or false"),
        ({"policy": {"max_epsilon": -1.0}}, "max_epsilon: must be >= 0"),
        ({"policy": {"lifetime_epsilon": -1.0}}, "lifetime_epsilon: must be >= 0"),
        ({"policy": {"lifetime_delta": 1.0}}, r"lifetime_delta: must lie in \(0, 1\)"),
        ({"policy": {"privacy_unit": "row"}}, "privacy_unit: must be 'patient' or 'image'"),
        ({"data": {"classes": "A"}}, "classes: must be a list"),
        ({"data": {"classes": ["A", "A"]}}, "lists a class twice"),
        ({"data": {"cache_dir": "x"}}, "either cache or cache_dir"),
        ({"client": {"role": "boss"}}, "client.role: must be one of"),
        ({"client": {"site_id": None}}, "client.site_id: is required"),
        ({"identity": {"server_public_key": "abcd"}}, "32-byte Ed25519 key"),
        ({"identity": {"public_key": "zz"}}, "Ed25519 key in hex"),
        ({"tls": {"cert": "missing.pem"}}, "does not exist"),
        ({"client": {"poll_interval_s": 0.0}}, "poll_interval_s: must be >="),
        ({"policy": {"allowed_aggregation": []}}, "allowed_aggregation: must be a non-empty"),
        ({"policy": {"allowed_aggregation": ["clear"]}}, "allowed_aggregation: must be"),
        ({"policy": {"allowed_aggregation": "mask"}}, "allowed_aggregation: must be"),
        ({"policy": {"ckks_decryptor": "nobody"}}, "ckks_decryptor: 'nobody' has no identity"),
    ],
)
def test_invalid_values_name_the_key(
    kit: Path, tmp_path: Path, sections: dict[str, dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_client_config(_rewrite(kit, tmp_path, **sections))


def test_a_hand_written_policy_requires_protection(kit: Path, tmp_path: Path) -> None:
    """Without the keys a site allows mask and ckks only, pins no decryptor and keeps its
    coverage to itself; plaintext needs an explicit opt-in."""
    bare = _rewrite(
        kit,
        tmp_path,
        policy={"allowed_aggregation": None, "disclose_coverage": None, "ckks_decryptor": None},
    )
    policy = load_client_config(bare).policy
    assert policy.allowed_aggregation == ("mask", "ckks")
    assert policy.ckks_decryptor is None and policy.disclose_coverage is False
    opted = _rewrite(
        kit,
        tmp_path,
        policy={"allowed_aggregation": ["plaintext", "mask"], "ckks_decryptor": "site-b"},
    )
    policy = load_client_config(opted).policy
    assert policy.allowed_aggregation == ("plaintext", "mask")
    assert policy.ckks_decryptor == "site-b"


def test_identity_key_must_match_public_key(kit: Path, tmp_path: Path) -> None:
    other = tomllib.loads((kit.parent / "site-b" / "client.toml").read_text())
    path = _rewrite(kit, tmp_path, identity={"public_key": other["identity"]["public_key"]})
    with pytest.raises(ConfigError, match="does not match the identity key file"):
        load_client_config(path)


def test_unknown_keys_warn_and_missing_file_errors(kit: Path, tmp_path: Path) -> None:
    cfg = load_client_config(_rewrite(kit, tmp_path, data={"holdot": "x"}))
    assert any("holdot (did you mean 'holdout'?)" in w for w in cfg.warnings)
    with pytest.raises(ConfigError, match="no such config file"):
        load_client_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[client\n")
    with pytest.raises(ConfigError, match="cannot read TOML"):
        load_client_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    ("typo", "meant"), [("min_cohrt", "min_cohort"), ("lifetime_epsilom", "lifetime_epsilon")]
)
def test_a_misspelt_policy_key_is_an_error_naming_the_key(
    kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], typo: str, meant: str
) -> None:
    """a site's protection settings are not left at their defaults by a typo."""
    from afl.client.cli import main

    path = _rewrite(kit, tmp_path, policy={typo: 5})
    with pytest.raises(
        ConfigError, match=f"unknown key \\[policy\\] {typo} \\(did you mean '{meant}'"
    ):
        load_client_config(path)
    assert main(["doctor", "--config", str(path), "--no-connect"]) != 0
    err = capsys.readouterr()
    text = err.out + err.err
    assert f"{typo} (did you mean '{meant}'?)" in text and "Traceback" not in text


def test_run_subcommand_reports_config_errors(
    kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from afl.client.cli import main

    assert main(["run", "--config", str(tmp_path / "missing.toml")]) == 1
    err = capsys.readouterr().err
    assert "afl-client run: error:" in err and "no such config file" in err
    # The provisioned kit has no feature cache yet: a clear error before any network traffic.
    assert main(["run", "--config", str(kit / "client.toml")]) == 1
    assert "is not a feature cache" in capsys.readouterr().err


def test_budget_subcommand_shows_the_ledger_and_refuses_a_broken_one(
    kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from afl.client.cli import main
    from afl.client.policy.ledger import DpLedger

    path = _rewrite(kit, tmp_path, client={"state_dir": str(tmp_path / "state")})
    assert main(["budget", "--config", str(path)]) == 0
    assert "lifetime: ε = 0 at δ = 1e-05 over 0 release(s)" in capsys.readouterr().out
    ledger = DpLedger(tmp_path / "state" / "dp-ledger")
    for i, mu in enumerate((0.3, 0.4), start=1):
        ledger.record(
            federation_id="f", round_id=f"r{i}", round_number=1, run_id=f"r{i}",
            plan_sha256="00", aggregation="AGGREGATION_MODE_MASK", unit="patient",
            images_per_patient=1, delta=1e-5, mu=mu, epsilon=1.0, releases=(),
        )  # fmt: skip
    assert main(["budget", "--config", str(path), "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert [e["round_id"] for e in doc["entries"]] == ["r1", "r2"]
    assert doc["mu"] == pytest.approx(0.5) and doc["head_sha256"] == ledger.head()
    first = sorted((tmp_path / "state" / "dp-ledger").iterdir())[0]
    first.write_text(first.read_text().replace('"mu": 0.3', '"mu": 0.01'))
    assert main(["budget", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("afl-client budget: error: DP ledger") and "chain breaks" in err
