"""docs/operations.md is the path a hospital and the coordinator's operator follow, and it works:
its marked commands run verbatim (tests/helpers/doc_commands.py reads the marks) as an operator,
a coordinator and three hospitals on this machine.

The hospitals' images are written here: PNG at one site, JPEG at another, DICOM at the third (five
transfer syntaxes, four of them compressed, some with a VOI window), each with a manifest that
lists only the classes that site labels — a different subset each. The path: production
provisioning (`afl ca init`, `afl ca server-init`, `afl-client init`, `afl ca sign`, `afl-client
init --import` against the roster fingerprint the operator published), the weights check,
extraction, `[data]` and `[policy]`, `afl-client doctor`, `server.toml` with no mask bound in it,
`afl-server check`, the daemons, a masked round, the status commands and `afl verify-log`. No
network here: the weights file is a stand-in of the right architecture (random weights, its last
normalisation scaled so the features have the magnitude of trained ones), under the published
file's name and pinned by its digest exactly as the document says for the real file.

Oracles: the pooled ridge solve in numpy on the caches the sites extracted (balanced targets,
the default γ = 1); the sites' request fingerprints as the operator's `afl ca sign` printed them.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import torch

from afl.client.features.backbones import BACKBONES
from afl.core.data.featurecache import open_cache
from afl.lab.demo.federation import free_port
from tests.client.imagegen import write_hospital
from tests.helpers.doc_commands import (
    Party,
    Step,
    StepRunner,
    base_environment,
    doc_steps,
    edit_target,
    used_variables,
    variables_block,
)
from tests.helpers.numeric import pooled_ridge, relative_error
from tests.helpers.pipeline import weights_file

ROOT = Path(__file__).resolve().parents[1]
# The operator and the coordinator install the server dependencies only (§1): their commands run
# with the client's and the lab's packages unimportable (tests/helpers/unimportable).
SERVER_ONLY = {
    "PYTHONPATH": os.pathsep.join(
        p
        for p in (str(ROOT / "tests" / "helpers" / "unimportable"), os.environ.get("PYTHONPATH"))
        if p
    ),
    "AFL_TEST_UNIMPORTABLE": "torch,torchvision,torchxrayvision,matplotlib,sklearn,PIL,pydicom",
}
DOC = ROOT / "docs" / "operations.md"
BACKBONE = "xrv-densenet121-all"
# The classes of the document's server.toml, and what each hospital labels (its manifest's columns).
LABELS = {
    "hospital-a": ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Pneumothorax"],
    "hospital-b": ["Effusion", "Mass", "Nodule", "Pneumonia", "Pneumothorax"],
    "hospital-c": ["Atelectasis", "Cardiomegaly", "Infiltration", "Mass", "Nodule", "Pneumonia"],
}
IMAGES = 10
# The order a hospital and the operator go through: each pattern must match a marked command,
# in this order (the document may add others between them).
PATH = (
    r"afl ca init ",
    r"afl ca server-init ",
    r"afl-client init --kit \S+ --site-id ",
    r"afl ca sign ",
    r"afl-client init --kit \S+ --import \S+ --roster-fingerprint ",
    r"sha256sum --check",
    r"afl-client extract --manifest .*--weights \S+ --sha256 ",
    r"afl-client doctor --config \S+ --no-connect",
    r"afl-server check --config ",
    r"afl-server --config ",
    r"afl-client doctor --config \S+\n",
    r"afl-client run --config ",
    r"afl-server status --config ",
    r"afl-client status --config ",
    r"afl ca admin-kit ",
    r"afl admin --config \S+ ls\n",
    r"afl verify-log ",
    r"afl log export --config ",
)


def _steps() -> list[Step]:
    return doc_steps(DOC.read_text(encoding="utf-8"))


def test_the_documented_path_is_marked_and_self_contained() -> None:
    """Static: the path's commands are marked in order, every variable they use is one the
    document asks the reader to set (or one a marked block exports), and the path uses the real
    weights file (no random-init shortcut)."""
    steps = _steps()
    commands = [s for s in steps if s.kind in ("run", "start")]
    text = "\n".join(s.body.replace("\\\n", " ") for s in commands)
    position = 0
    for pattern in PATH:
        match = re.compile(pattern).search(text, position)
        assert match, f"docs/operations.md: no marked command {pattern!r} after the previous ones"
        position = match.end()
    edited = "\n".join(s.body for s in steps if s.kind == "edit")
    assert "--random-init" not in text and "allow_random_init" not in text + edited
    declared = variables_block(steps) | {"AFL_CA_PASSPHRASE"}  # read by the first operator block
    for step in steps:
        unknown = used_variables(step) - declared
        assert not unknown, f"{step.where()} uses {sorted(unknown)}, not in the variables block"
    edits = [s for s in steps if s.kind == "edit"]
    assert {s.party for s in edits} == {"site", "coordinator"}
    for step in edits:
        tomllib.loads(step.body)  # the TOML a person writes is valid as shown


def test_edit_blocks_fit_the_templates_as_shown() -> None:
    """a block appended as shown does not repeat a table the provisioned
    template already has (TOML: "Cannot declare ('client',) twice"); a block marked with a table
    changes keys of a table the template has."""
    from afl.client.policy.defaults import production_policy_toml
    from afl.ops.provisioning import _client_toml, _server_toml

    key, peers = b"\x01" * 32, {"s1": b"\x02" * 32}
    templates = {  # what the production bundle and the site's import write
        "$KIT/client.toml": _client_toml(
            site_id="s1", federation_id="f", server_address="localhost:1", role="participant",
            site_public=peers["s1"], server_public=key, peers=peers, policy=None,
        ) + production_policy_toml(ckks_decryptor=None),
        "$SERVER_KIT/server.toml": _server_toml(
            federation_id="f", listen="[::]:1", server_public=key, peers=peers,
            roles={"s1": "participant"}, round_settings=None,
        ),
    }  # fmt: skip
    edits = [s for s in _steps() if s.kind == "edit"]
    assert {edit_target(s)[1] for s in edits} >= {("client",), ("data",), ("server",), ("round",)}
    for step in edits:
        target, table = edit_target(step)
        text = templates[target]
        if table:
            assert table[0] in tomllib.loads(text), f"{step.where()}: no [{table[0]}] in {target}"
        else:
            tomllib.loads(text + "\n" + step.body)  # appending as shown keeps the file valid


def _stand_in_weights(folder: Path) -> Path:
    """A state dict of the backbone's architecture under the published file's name; the final
    BatchNorm is scaled by 1e-3 so that its ReLU features (exactly proportional) have row norms
    of tens, like trained weights, instead of ~3e4."""
    folder.mkdir(parents=True)
    state = torch.load(weights_file(folder, BACKBONE), weights_only=True)
    for key in ("features.norm5.weight", "features.norm5.bias"):
        state[key] = state[key] * 1e-3
    path = folder / BACKBONES[BACKBONE].weights_filename
    torch.save(state, path)
    return path


def _parties(tmp: Path, weights: Path) -> dict[str, Party]:
    """The variables of docs/operations.md's variables block, pointing into ``tmp``."""
    base = base_environment()
    base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '/usr/bin:/bin')}"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    everyone = {**base, "AFL_HOST": "localhost", "AFL_PORT": str(free_port())}
    everyone["WEIGHTS_SHA256"] = digest
    parties = {
        "operator": Party(
            "operator", tmp / "operator", {**everyone, **SERVER_ONLY}, stdin="correct horse\n" * 2
        ),
        "coordinator": Party(
            "coordinator",
            tmp / "coordinator" / "home",
            {
                **everyone,
                **SERVER_ONLY,
                "SERVER_KIT": str(tmp / "coordinator" / "etc" / "server"),
                "SERVER_STATE": str(tmp / "coordinator" / "var" / "afl-server"),
                "WEIGHTS": str(weights),
            },
        ),
    }
    for site in LABELS:
        machine = tmp / site
        parties[site] = Party(
            site,
            machine / "home",
            {
                **everyone,
                "SITE": site,
                "KIT": str(machine / "etc" / "sites" / site),
                "DATA": str(machine / "srv" / site),
                "SITE_STATE": str(machine / "var" / "afl-client" / site),
                "WEIGHTS": str(weights),
            },
        )
    for party in parties.values():
        party.cwd.mkdir(parents=True)
    return parties


def test_a_federation_of_three_hospitals_follows_the_document(tmp_path: Path) -> None:
    weights = _stand_in_weights(tmp_path / "weights")
    parties = _parties(tmp_path, weights)
    for index, (site, kind) in enumerate(zip(LABELS, ("png", "jpeg", "dicom"), strict=True)):
        data, classes = Path(parties[site].env["DATA"]), LABELS[site]
        write_hospital(
            data,
            kind=kind,
            classes=classes,
            count=IMAGES,
            seed=index,
            images="images",
            patients=True,
        )
    printed: dict[str, str] = {}  # request fingerprints as each site read them to the operator

    def published(step: Step, party: Party, output: str) -> None:
        if "afl-client init" in step.body and "--site-id" in step.body:
            printed[party.name] = re.findall(r"fingerprint \(read it .*\): (.+)", output)[0]
        if party.name == "operator" and "afl ca sign" in step.body:
            for site, mine in printed.items():  # compare before sending anything (step 4)
                assert re.search(rf"site '{site}'\s+fingerprint {mine}", output), output
            roster = re.findall(r"roster fingerprint: (.+)", output)[0]
            for site in LABELS:
                parties[site].env["ROSTER_FINGERPRINT"] = roster

    runner = StepRunner(parties, logs=tmp_path / "logs", on_output=published)
    try:
        for step in _steps():
            runner.execute(step)
    finally:
        codes = runner.stop()
    assert codes["coordinator"] == [0], (tmp_path / "logs" / "coordinator-daemon-0.log").read_text()
    assert sorted(printed) == sorted(LABELS)

    outputs = {(step.body, name): text for step, name, text in runner.outputs}
    server_env, server_status = parties["coordinator"].env, ""
    for (body, name), text in outputs.items():
        if body.startswith("afl-server status"):
            server_status = text
        if body.startswith("afl-client doctor"):  # both checks, before and after the start
            assert text.rstrip().endswith("ready: `afl-client run --config ...`"), text
            assert f"{IMAGES} images" in text and "RANDOM-INIT" not in text, text
            if "--no-connect" not in body:
                assert "mutual TLS" in text, text
            for label in LABELS[name]:
                assert f"class {label}: 5 positive, 5 negative" in text, text
    assert re.search(r"round \S+ \(number 1\): PUBLISHED\n", server_status), server_status
    assert "last error: none" in server_status and "deadline" not in server_status, server_status
    assert server_status.count("coverage not disclosed") == len(LABELS), server_status  # global

    # The round was masked and nobody set a bound; the features came from the pinned weights.
    config = tomllib.loads((Path(server_env["SERVER_KIT"]) / "server.toml").read_text())
    assert config["round"]["aggregation"] == "mask"
    bounds = ("mask_feature_norm", "mask_max_samples", "mask_gram_bound", "mask_vector_bound")
    assert all(config["round"][key] == 0 for key in bounds)
    assert config["round"]["backbone_sha256"] == server_env["WEIGHTS_SHA256"]
    caches = {site: Path(parties[site].env["DATA"]) / "cache" for site in LABELS}
    for site, cache in caches.items():
        meta = open_cache(cache).meta
        assert meta.n == IMAGES, site  # every image decoded, every DICOM transfer syntax included
        assert tuple(meta.classes) == tuple(LABELS[site])
        assert server_env["WEIGHTS_SHA256"] in meta.source

    # Every hospital holds the verified model of the pooled solve, and says what it left out.
    oracle = pooled_ridge(caches.values(), classes=config["round"]["classes"], gamma=1.0)
    for site in LABELS:
        state = Path(parties[site].env["SITE_STATE"])
        (model,) = list((state / "models").glob("*.weights.npy"))
        assert relative_error(np.load(model), oracle) < 1e-9, site
        (report,) = [p.read_text() for p in (state / "reports").glob("*.json")]
        assert '"outcome": "COMPLETED"' in report and "contributes nothing for" in report, site
    assert re.search(r"\d+ records", outputs[('afl verify-log "$SERVER_STATE"\n', "coordinator")])
    log_block = next(text for (body, _), text in outputs.items() if body.startswith("afl log"))
    assert "statements verify" in log_block and "(quorum 2)" in log_block, log_block
    # The admin kit made on the CA machine serves the operator from the coordinator host.
    (listing,) = [text for (body, _), text in outputs.items() if body.startswith("afl admin")]
    assert re.search(r"run-1\s.*published", listing), listing
    assert (parties["coordinator"].cwd / "run-1.model").stat().st_size > 0
