"""`afl-client evaluate` at a site that labels only some of the federation's classes: the
documented commands (``--cache`` and ``--manifest``) evaluate the classes the site
labels; the metrics are checked against scikit-learn on σ(H W) (an independent oracle)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from afl.client.cli import main as client_main
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.ops.provisioning import ProvisionedFederation
from afl.server.solve.model import build_signed_model
from tests.helpers.federation import FederationSpec, rewrite_client_toml
from tests.helpers.pipeline import pipeline_probabilities, weights_file, write_images

FEDERATION = FederationSpec(sites=["site-a", "site-b"], port=50998, federation_id="fed-eval")
CLASSES = ("Effusion", "Mass", "Nodule")  # the federation's; the site labels Effusion only
D = 512  # resnet18


@pytest.fixture(scope="module")
def site(federation: ProvisionedFederation, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("evaluate")
    key = generate_identity_key()
    config = rewrite_client_toml(
        federation.site_dirs["site-a"],
        tmp,
        client={"state_dir": str(tmp / "state")},
        data={"classes": ["Effusion"]},
        identity={"server_public_key": public_key_to_raw(key).hex()},
    )
    w = np.random.default_rng(1).normal(size=(D, len(CLASSES))) / 40
    signed = build_signed_model(
        w,
        identity_key=key,
        federation_id="fed-eval",
        round_id="r1-eval",
        round_number=1,
        classes=CLASSES,
        gamma=1.0,
        backbone="resnet18",
        contributors=["site-a", "site-b", "site-c"],
        plan_bytes=b"plan",
    )
    model = tmp / "state" / "models" / "r1-eval.signed-model.pb"  # as the daemon keeps it
    model.parent.mkdir(parents=True)
    model.write_bytes(signed.SerializeToString())
    return {"tmp": tmp, "config": config, "model": model, "w": w}


def _report(site: dict[str, Any]) -> dict[str, Any]:
    path = site["tmp"] / "state" / "reports" / "r1-eval.json"
    local: dict[str, Any] = json.loads(path.read_text())["local_evaluation"]
    return local


def test_evaluate_a_partial_label_site_on_its_cache(site, capsys) -> None:
    rng = np.random.default_rng(2)
    features = rng.normal(size=(60, D)).astype(np.float32)
    labels = (rng.random((60, 1)) < 0.4).astype(np.int8)  # the site's own class only
    cache = site["tmp"] / "holdout"
    meta = CacheMeta(n=60, d=D, classes=("Effusion",), source="test")
    write_cache(
        cache, meta=meta, ids=[f"i{i}" for i in range(60)], labels=labels, features=features
    )
    argv = ["evaluate", "--config", str(site["config"]), "--model", str(site["model"])]
    assert client_main([*argv, "--cache", str(cache), "--bootstrap", "50"]) == 0
    assert "Effusion" in capsys.readouterr().out
    local = _report(site)
    assert sorted(local["per_class"]) == ["Effusion"]
    p = 1 / (1 + np.exp(-(features.astype(np.float64) @ site["w"][:, 0])))
    expected = roc_auc_score(labels[:, 0] == 1, p)
    assert local["per_class"]["Effusion"]["auc"]["estimate"] == pytest.approx(expected, abs=1e-12)


def test_evaluate_a_partial_label_site_on_a_manifest(site, capsys) -> None:
    folder = site["tmp"] / "images"
    manifest = write_images(folder)
    names = [line for line in manifest.read_text().splitlines()[1:]]
    rows = [f"{n},{i % 2}" for i, n in enumerate(names)]  # a column for Effusion only
    manifest.write_text("path,Effusion\n" + "\n".join(rows) + "\n")
    weights = weights_file(site["tmp"], "resnet18")
    argv = ["evaluate", "--config", str(site["config"]), "--model", str(site["model"])]
    argv += ["--manifest", str(manifest), "--weights", str(weights), "--bootstrap", "20"]
    assert client_main(argv) == 0
    capsys.readouterr()
    local = _report(site)
    assert sorted(local["per_class"]) == ["Effusion"]
    assert (local["per_class"]["Effusion"]["n_pos"], local["per_class"]["Effusion"]["n_neg"]) == (
        2,
        2,
    )
    from afl.client.features.backbones import load_backbone

    backbone = load_backbone("resnet18", weights=str(weights))
    p = pipeline_probabilities(site["tmp"], backbone, manifest, site["w"])[:, 0]
    expected = roc_auc_score([i % 2 == 1 for i in range(len(names))], p)
    assert local["per_class"]["Effusion"]["auc"]["estimate"] == pytest.approx(expected, abs=1e-6)


def test_a_hold_out_without_any_of_the_sites_classes_names_the_cause(site, capsys) -> None:
    cache = site["tmp"] / "other-holdout"
    meta = CacheMeta(n=4, d=D, classes=("Mass",), source="test")
    labels = np.array([[0], [1], [0], [1]], dtype=np.int8)
    write_cache(cache, meta=meta, ids=list("abcd"), labels=labels, features=np.zeros((4, D)))
    argv = ["evaluate", "--config", str(site["config"]), "--model", str(site["model"])]
    assert client_main([*argv, "--cache", str(cache)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "none of the model's classes" in err
    assert "Traceback" not in err
