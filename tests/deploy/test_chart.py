"""The Helm chart deploy/helm/afl, rendered and checked (docs/operations.md §15).

Rendering: Helm's own Go SDK through the ``helm-python-sdk`` wheel (libhelm_c over
helm.sh/helm/v4, loaded with ctypes): the same template engine, Sprig functions and values
coalescing as the ``helm`` binary, which is not installable from the registries this project
uses. Validation: ``kubernetes_validate``'s strict JSON schemas of the Kubernetes API (1.27, the
oldest version the chart supports, and 1.37); the two CRD kinds (cert-manager's Certificate, the
Prometheus Operator's ServiceMonitor) have no schema there and are checked field by field here.
Policy: checkov (optional: it is heavy; the test skips where no ``checkov`` is on PATH or in
``$AFL_CHECKOV``), every finding it reports must be one explained in :data:`EXPLAINED`, and every
explanation must still be needed.

The document is followed verbatim: its ``kubectl create`` commands run with
``--dry-run=client -o json`` against a provisioned kit after the document's TOML edits, its
``helm`` commands are rendered with the same values files and ``--set`` flags, and each pod's kit
volume is laid out from those Secrets and ConfigMaps exactly as the kubelet would (keys to paths)
and loaded by afl's own config loaders and TLS kit checks.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from afl.client.config import load_client_config
from afl.crypto.identity.kit_check import PROBLEM, check_tls_kit
from afl.ops.provisioning import ProvisionedFederation, provision
from afl.server.config import load_config
from afl.server.daemon.main import load_identity_key
from afl.server.toml_text import dumps
from tests.deploy.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSIONS,
    HelmCommand,
    K8sBlock,
    command_values,
    k8s_blocks,
    merge,
    parse_helm,
    pod_specs,
    render,
    render_command,
    secret_and_config_refs,
    validate,
)

PARTIES = ("coordinator", "site", "decryptor")
#: checkov findings the chart keeps, and why (the test fails on any other finding, and on an
#: explanation no longer needed).
EXPLAINED = {
    "CKV_K8S_43": "image by digest: the documented values name a tag because the digest exists "
    "only once the cloud team has pushed its build; `image.digest` pins it (docs/operations.md "
    "§15 says to) and test_a_digest_pins_the_image shows the finding goes away",
    "CKV_K8S_15": "imagePullPolicy Always: IfNotPresent is deliberate; with a digest the image "
    "is immutable, and a restarted hospital pod must not depend on reaching the registry",
    "CKV_K8S_8": "liveness probe on the site and decryptor: afl-client serves no port (sites "
    "only dial out); a daemon that stops ends its container, which Kubernetes restarts",
    "CKV_K8S_9": "readiness probe on the site and decryptor: no Service routes to them, so "
    "readiness gates nothing",
}
#: Which party each explained finding may appear for.
EXPLAINED_FOR = {
    "CKV_K8S_43": set(PARTIES),
    "CKV_K8S_15": set(PARTIES),
    "CKV_K8S_8": {"site", "decryptor"},
    "CKV_K8S_9": {"site", "decryptor"},
}


def _helm_commands() -> list[tuple[K8sBlock, HelmCommand]]:
    return [
        (block, parse_helm(command))
        for block in k8s_blocks()
        for command in block.commands()
        if command.startswith("helm ")
    ]


def _ids() -> list[str]:
    return [f"{b.party}:{b.line}" for b, _ in _helm_commands()]


def test_the_kubernetes_section_is_marked_and_well_formed() -> None:
    blocks = k8s_blocks()
    assert {b.party for b in blocks} == set(PARTIES)
    for block in blocks:
        if block.edit:
            tomllib.loads(block.body)
            continue
        for command in block.commands():
            assert command.startswith(("kubectl ", "helm upgrade --install ")), command
    for block, helm in _helm_commands():
        assert helm.chart == CHART and helm.namespace == "afl"
        for path in helm.values_files:
            assert path.is_file(), f"{path} (docs/operations.md:{block.line}) does not exist"
        assert command_values(helm)["component"] == block.party
    assert {b.party for b, _ in _helm_commands()} == set(PARTIES)


@pytest.mark.parametrize(("block", "command"), _helm_commands(), ids=_ids())
def test_the_documented_releases_render_and_validate(block: K8sBlock, command: HelmCommand) -> None:
    objects = render_command(command)
    kinds = [o["kind"] for o in objects]
    for obj in objects:
        assert obj["metadata"]["namespace"] == "afl", obj["metadata"]
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == CRD_KINDS[obj["kind"]]
            continue
        for version in KUBE_VERSIONS:
            validate(obj, version)
    # Never a Secret, never key material: keys only come from Secrets that exist beforehand.
    assert "Secret" not in kinds
    assert "PRIVATE KEY" not in yaml.safe_dump_all(objects)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    for workload, spec in pod_specs(objects):
        _check_hardened(workload["metadata"]["name"], spec)
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    mounts = {
        m["mountPath"]: m
        for m in deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts["/etc/afl/kit"]["readOnly"] is True and "readOnly" not in mounts["/var/lib/afl"]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    own = policies[deployment["metadata"]["name"]]
    assert own["policyTypes"] == ["Ingress", "Egress"]
    if block.party == "coordinator":
        _check_coordinator(objects, deployment, own, command)
    else:
        _check_dialler(objects, deployment, own, block.party)


def _check_hardened(name: str, spec: Mapping[str, Any]) -> None:
    assert spec["automountServiceAccountToken"] is False, name
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] >= 10000, name
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
    for container in spec["containers"]:
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert container["resources"]["limits"] and container["resources"]["requests"], name


def _check_coordinator(
    objects: list[dict[str, Any]],
    deployment: Mapping[str, Any],
    policy: Mapping[str, Any],
    command: HelmCommand,
) -> None:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    health = int(args[args.index("--health-port") + 1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health, probe
    assert container["readinessProbe"]["grpc"]["service"] == "afl.proto.v1.Coordinator"
    assert args[args.index("--metrics-address") + 1] == "0.0.0.0"
    metrics = int(args[args.index("--metrics-port") + 1])
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    name = deployment["metadata"]["name"]
    assert services[f"{name}-metrics"]["spec"]["type"] == "ClusterIP"
    assert services[f"{name}-metrics"]["spec"]["ports"][0]["port"] == metrics
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    labels = services[f"{name}-metrics"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # The coordinator dials nobody; it is reached on gRPC (sites, the admin Job) and metrics only.
    assert policy["egress"] == []
    ports = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert ports == {"grpc", "metrics"}
    values = command_values(command)
    (job,) = [o for o in objects if o["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["afl", "admin"]
    certificates = [o for o in objects if o["kind"] == "Certificate"]
    if values.get("tls", {}).get("certManager", {}).get("enabled"):
        (certificate,) = certificates
        spec = certificate["spec"]
        assert spec["usages"] == ["digital signature", "server auth"]
        assert spec["privateKey"]["algorithm"] == "ECDSA"
        assert {name, f"{name}.afl.svc", "afl.example.org"} <= set(spec["dnsNames"])
        assert spec["issuerRef"]["name"] == "afl-federation-ca"
        refs = secret_and_config_refs(deployment["spec"]["template"]["spec"])
        assert ("Secret", spec["secretName"]) in refs
    else:
        assert certificates == []


def _check_dialler(
    objects: list[dict[str, Any]],
    deployment: Mapping[str, Any],
    policy: Mapping[str, Any],
    party: str,
) -> None:
    """A site or the decryptor: no Service, no ingress, egress to the coordinator and DNS only."""
    assert not [o for o in objects if o["kind"] in ("Service", "ServiceMonitor", "Job")]
    assert policy["ingress"] == []
    (to_coordinator, dns) = policy["egress"]
    assert to_coordinator["to"] == [{"ipBlock": {"cidr": "192.0.2.10/32"}}]
    assert to_coordinator["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert {p["port"] for p in dns["ports"]} == {53}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["run", "--config", "/etc/afl/kit/client.toml"]
    assert "ports" not in container
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert ("/data" in mounts) == (party == "site")


def test_the_schema_validation_catches_a_wrong_field() -> None:
    """The validator is strict: a misspelt field and a wrong type are errors."""
    import kubernetes_validate

    command = _helm_commands()[0][1]
    (deployment,) = [o for o in render_command(command) if o["kind"] == "Deployment"]
    deployment["spec"]["strategy"]["tpye"] = "Recreate"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBE_VERSIONS[0])
    del deployment["spec"]["strategy"]["tpye"]
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBE_VERSIONS[0])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"identity": {"existingSecret": ""}}, "identity.existingSecret is required"),
        ({"tls": {"existingSecret": ""}}, "tls.existingSecret is required"),
        ({"config": {"existingConfigMap": ""}}, "config.existingConfigMap is required"),
        ({"data": {"existingClaim": ""}}, "data.existingClaim is required"),
        ({"networkPolicy": {"coordinatorTo": []}}, "networkPolicy.coordinatorTo is required"),
        ({"tls": {"certManager": {"enabled": True}}}, "for the coordinator only"),
        ({"component": "server"}, "component must be coordinator, site or decryptor"),
    ],
)
def test_the_chart_refuses_incomplete_values_with_the_cause(
    change: dict[str, Any], message: str
) -> None:
    """A missing Secret or setting fails the render naming the value (no half-made release)."""
    import helm_python

    (command,) = [c for b, c in _helm_commands() if b.party == "site"]
    values = merge(command_values(command), change)
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values, release="afl-site", namespace="afl")


def test_values_are_documented_and_the_templates_use_only_them() -> None:
    """Every top-level value has a comment above it, and every ``.Values.X.Y`` a template reads
    exists in values.yaml (a typo in a template cannot silently read nothing)."""
    text = (CHART / "values.yaml").read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-zA-Z]+:", line):
            assert lines[i - 1].startswith("#"), f"values.yaml: {line!r} has no comment above it"
    values = yaml.safe_load(text)
    for template in (CHART / "templates").iterdir():
        for path in re.findall(r"\.Values((?:\.[A-Za-z]+)+)", template.read_text()):
            node: Any = values
            for key in path.strip(".").split("."):
                assert isinstance(node, dict) and key in node, f"{template.name}: .Values{path}"
                node = node[key]


def test_helm_lint_finds_no_error() -> None:
    import helm_python

    for _, command in _helm_commands():
        result = helm_python.lint(str(CHART), command_values(command), namespace="afl")
        assert result["errors"] == [], result
        severe = [m for m in result["messages"] if m["severity"] > 1]  # 1: INFO
        assert severe == [], result


def test_a_digest_pins_the_image() -> None:
    (command,) = [c for b, c in _helm_commands() if b.party == "site"]
    digest = "sha256:" + "ab" * 32
    values = merge(command_values(command), {"image": {"digest": digest}})
    (deployment,) = [
        o for o in render(values, release="afl-site", namespace="afl") if o["kind"] == "Deployment"
    ]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"registry.example.org/afl/afl-client@{digest}"


# --- the document followed against a real kit ------------------------------------------------------


def _kubectl() -> str:
    tool = shutil.which("kubectl")
    if tool is None:
        pytest.skip("kubectl is not installed (Debian: kubernetes-client)")
    return tool


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> ProvisionedFederation:
    return provision(
        tmp_path_factory.mktemp("k8s") / "federation",
        sites=["hospital-a", "hospital-b", "hospital-c", "decryptor"],
        decryptor="decryptor",
        server_hosts=["afl.example.org", "afl-coordinator.afl.svc"],
        federation_id="fed-k8s",
        # §4.1 done: the coordinator's [round] is complete before §15.
        round_settings={"classes": ["Effusion", "Mass"], "feature_dim": 16, "aggregation": "mask"},
    )


def _environment(kit: ProvisionedFederation, party: str, home: Path) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    env["KUBECONFIG"] = str(home / "no-cluster")  # --dry-run=client: no cluster is asked
    if party == "coordinator":
        env["SERVER_KIT"] = str(kit.server_dir)
    else:
        site = "hospital-a" if party == "site" else "decryptor"
        env.update(SITE=site, KIT=str(kit.site_dirs[site]))
    return env


def _follow(kit: ProvisionedFederation, party: str, tmp: Path) -> list[dict[str, Any]]:
    """The party's §15 blocks in order: edits applied, kubectl run (dry run), helm rendered.
    Returns the objects kubectl made and, after each helm command, the ones it rendered."""
    tool = _kubectl()
    home = tmp / party
    home.mkdir()
    if party == "coordinator":  # the admin kit of §6, in the coordinator's working folder
        shutil.copytree(kit.root / "admins" / "operator", home / "admin-kit")
    env = _environment(kit, party, home)
    made: list[dict[str, Any]] = []
    for block in [b for b in k8s_blocks() if b.party == party]:
        if block.edit:
            target = Path(re.sub(r"\$(\w+)", lambda m: env[m[1]], block.edit))
            path = target if target.is_absolute() else home / target
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
            merge(doc, tomllib.loads(block.body))
            path.write_text(dumps(doc), encoding="utf-8")
            continue
        for command in block.commands():
            if command.startswith("helm "):
                rendered = render_command(parse_helm(command))
                made.extend({**o, "_rendered_by": command} for o in rendered)
                continue
            result = subprocess.run(
                ["bash", "-c", f"{command} --dry-run=client -o json"],
                cwd=home,
                env={**env, "KUBECTL": tool},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{command}: {result.stderr}"
            made.append(json.loads(result.stdout))
    return made


def _lay_out_volume(
    volume: Mapping[str, Any], objects: Mapping[tuple[str, str], Mapping[str, Any]], into: Path
) -> None:
    """A projected or secret volume as the kubelet writes it: each item's key to its path."""
    into.mkdir(parents=True)
    sources = volume.get("projected", {}).get("sources")
    if sources is None:
        sources = [{"secret": {"name": volume["secret"]["secretName"]}}]
    for source in sources:
        kind, ref = (
            ("Secret", source["secret"])
            if "secret" in source
            else ("ConfigMap", source["configMap"])
        )
        obj = objects[(kind, ref["name"])]
        data = (
            {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
            if kind == "Secret"
            else {k: v.encode() for k, v in obj.get("data", {}).items()}
        )
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            assert item["key"] in data, f"{kind} {ref['name']} has no key {item['key']}"
            (into / item["path"]).write_bytes(data[item["key"]])
            (into / item["path"]).chmod(0o600)


@pytest.mark.parametrize("party", PARTIES)
def test_the_document_gives_each_pod_a_kit_afl_loads(
    kit: ProvisionedFederation, party: str, tmp_path: Path
) -> None:
    made = _follow(kit, party, tmp_path)
    created = {(o["kind"], o["metadata"]["name"]): o for o in made if "_rendered_by" not in o}
    assert ("Namespace", "afl") in created
    assert all(o["metadata"].get("namespace", "afl") == "afl" for o in created.values())
    renders: dict[str, list[dict[str, Any]]] = {}
    for obj in made:
        if "_rendered_by" in obj:
            renders.setdefault(obj.pop("_rendered_by"), []).append(obj)
    assert renders
    for command, objects in renders.items():
        from_certificates = {o["spec"]["secretName"] for o in objects if o["kind"] == "Certificate"}
        for workload, spec in pod_specs(objects):
            for (kind, name), keys in secret_and_config_refs(spec).items():
                if kind == "Secret" and name in from_certificates:
                    continue  # cert-manager writes it (tls.crt, tls.key, ca.crt)
                assert (kind, name) in created, f"{command}: {kind} {name} is never created"
                present = set(created[(kind, name)].get("data", {}))
                assert keys <= present, f"{kind} {name} lacks {keys - present}"
            if from_certificates:
                continue
            root = tmp_path / "pods" / workload["metadata"]["name"] / str(len(command))
            for volume in spec["volumes"]:
                if "projected" in volume or "secret" in volume:
                    _lay_out_volume(volume, created, root / volume["name"])
            if workload["kind"] == "Job":
                _check_admin_kit(root / "admin-kit", objects)
            else:
                _check_pod_kit(party, root / "kit")


def _check_pod_kit(party: str, kit_dir: Path) -> None:
    """The pod's /etc/afl/kit loaded by afl's loaders; its state_dir is on the volume."""
    if party == "coordinator":
        server = load_config(kit_dir / "server.toml")
        load_identity_key(server)
        ca, cert, key, state = server.ca_cert, server.cert, server.key, server.state_dir
    else:
        client = load_client_config(kit_dir / "client.toml")
        assert client.role == ("decryptor" if party == "decryptor" else "participant")
        ca, cert, key = client.tls.ca_cert, client.tls.cert, client.tls.key
        state = client.state_dir
        assert client.identity_key_path.read_bytes().startswith(b"-----BEGIN")
        if party == "site":  # a Deployment's daemon stays up between runs
            assert str(client.data.cache) == "/data/cache" and client.serve
    assert str(state) == "/var/lib/afl/state"
    findings = check_tls_kit(ca_cert=ca, cert=cert, key=key)
    assert not [f for f in findings if f.level == PROBLEM], findings


def _check_admin_kit(kit_dir: Path, objects: list[dict[str, Any]]) -> None:
    """admin.toml dials the Service's in-cluster name on its gRPC port, and the server
    certificate (the kit's) names it."""
    from cryptography import x509

    admin = tomllib.loads((kit_dir / "admin.toml").read_text())["admin"]
    host, port = admin["server"].rsplit(":", 1)
    (service,) = [o for o in objects if o["kind"] == "Service" and o["spec"]["type"] != "ClusterIP"]
    assert host == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert int(port) == service["spec"]["ports"][0]["port"]
    ca = x509.load_pem_x509_certificate((kit_dir / "ca.pem").read_bytes())
    assert ca.subject.rfc4514_string()
    assert (kit_dir / "admin.key").read_bytes().startswith(b"-----BEGIN")


# --- the policy linter ------------------------------------------------------------------------------


def _checkov() -> str:
    tool = os.environ.get("AFL_CHECKOV") or shutil.which("checkov")
    if not tool:
        pytest.skip("checkov is not installed (optional: pip install checkov; or AFL_CHECKOV=PATH)")
    return tool


def test_the_policy_linter_finds_nothing_unexplained(tmp_path: Path) -> None:
    tool = _checkov()
    party_of: dict[str, str] = {}
    for index, (block, command) in enumerate(_helm_commands()):
        name = f"{index}-{block.party}.yaml"
        (tmp_path / name).write_text(yaml.safe_dump_all(render_command(command)))
        party_of[name] = block.party
    result = subprocess.run(
        [
            tool,
            "--directory",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--quiet",
            "--compact",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode in (0, 1), result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    assert sum(r["summary"]["passed"] for r in reports) > 0
    seen: dict[str, set[str]] = {}
    for r in reports:
        for failed in r["results"]["failed_checks"]:
            party = party_of[Path(failed["file_path"]).name]
            assert failed["check_id"] in EXPLAINED, f"unexplained: {failed}"
            assert party in EXPLAINED_FOR[failed["check_id"]], f"unexplained for {party}: {failed}"
            seen.setdefault(failed["check_id"], set()).add(party)
    assert set(seen) == set(EXPLAINED), (
        f"explanations no longer needed: {set(EXPLAINED) - set(seen)}"
    )
