"""The Helm chart of deploy/helm/afl as the tests see it: docs/operations.md §15's marked blocks,
the chart rendered by Helm's own Go SDK (``helm_python``: the ``helm-python-sdk`` wheel bundles
libhelm_c, a C ABI over helm.sh/helm/v4; no ``helm`` binary exists here) with the values and
``--set`` flags of the document's ``helm`` commands, and schema validation of the result with
``kubernetes_validate`` (the Kubernetes OpenAPI schemas as strict JSON schemas)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
CHART = ROOT / "deploy" / "helm" / "afl"
#: The oldest Kubernetes the chart supports (gRPC probes are GA from 1.27) and the newest schemas.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
#: Kinds of CRDs the chart may render (their schemas ship with cert-manager and the Prometheus
#: Operator, not with Kubernetes): checked structurally in the tests instead.
CRD_KINDS = {"Certificate": "cert-manager.io/v1", "ServiceMonitor": "monitoring.coreos.com/v1"}
_MARK = re.compile(r"^<!-- k8s: (\w+)(?: edit (\S+))? -->$")


@dataclass
class K8sBlock:
    """A ``<!-- k8s: PARTY [edit FILE] -->`` block of docs/operations.md."""

    party: str
    edit: str  # the file a TOML block edits ("" for a command block)
    body: str
    line: int

    def commands(self) -> list[str]:
        """The block's commands, one per line (continuations joined)."""
        text = self.body.replace("\\\n", " ")
        return [c.strip() for c in text.splitlines() if c.strip() and not c.startswith("#")]


def k8s_blocks(text: str | None = None) -> list[K8sBlock]:
    lines = (DOC.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks = []
    for i, raw in enumerate(lines):
        match = _MARK.match(raw.strip())
        if not match:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not lines[j].startswith("```"):
            raise ValueError(f"docs/operations.md:{i + 1}: k8s mark without a fenced block")
        end = next(k for k in range(j + 1, len(lines)) if lines[k].strip() == "```")
        body = "\n".join(lines[j + 1 : end]) + "\n"
        blocks.append(K8sBlock(match[1], match[2] or "", body, i + 1))
    return blocks


@dataclass
class HelmCommand:
    """``helm upgrade --install RELEASE CHART --namespace NS -f FILE... --set K=V...``."""

    release: str
    chart: Path
    namespace: str
    values_files: list[Path] = field(default_factory=list)
    sets: list[str] = field(default_factory=list)


def parse_helm(command: str) -> HelmCommand:
    argv = shlex.split(command)
    if argv[:3] != ["helm", "upgrade", "--install"]:
        raise ValueError(f"not a `helm upgrade --install` command: {command}")
    positional: list[str] = []
    parsed = HelmCommand("", Path(), "default")
    rest = iter(argv[3:])
    for arg in rest:
        if arg in ("--namespace", "-n"):
            parsed.namespace = next(rest)
        elif arg in ("-f", "--values"):
            parsed.values_files.append(ROOT / next(rest))
        elif arg == "--set":
            parsed.sets.append(next(rest))
        elif arg.startswith("-"):
            raise ValueError(f"option {arg} is not understood by the chart test: {command}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise ValueError(f"expected RELEASE CHART: {command}")
    parsed.release, parsed.chart = positional[0], ROOT / positional[1]
    return parsed


def merge(into: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's order of values: maps merge key by key, anything else is replaced."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def command_values(command: HelmCommand) -> dict[str, Any]:
    import helm_python

    values: dict[str, Any] = {}
    for path in command.values_files:
        merge(values, yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    for assignment in command.sets:
        merge(values, helm_python.parse_set_string(assignment))
    return values


def render(
    values: Mapping[str, Any], *, release: str, namespace: str, chart: Path = CHART
) -> list[dict[str, Any]]:
    """Every object the chart renders with ``values`` (Helm's SDK; NOTES.txt left out)."""
    import helm_python

    with helm_python.Chart.load(str(chart)) as loaded:
        files = loaded.render(dict(values), name=release, namespace=namespace, is_install=True)
    objects: list[dict[str, Any]] = []
    for name, text in sorted(files.items()):
        if name.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def render_command(command: HelmCommand) -> list[dict[str, Any]]:
    return render(
        command_values(command),
        release=command.release,
        namespace=command.namespace,
        chart=command.chart,
    )


def validate(obj: Mapping[str, Any], version: str) -> None:
    """Strict schema validation (unknown fields are errors); raises with the path at fault."""
    import kubernetes_validate

    kubernetes_validate.validate(dict(obj), version, strict=True)


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec) of every Deployment and Job."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def secret_and_config_refs(spec: Mapping[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> the keys a pod spec reads from Secrets and ConfigMaps (None: all)."""
    refs: dict[tuple[str, str], set[str]] = {}
    for volume in spec.get("volumes", []):
        sources = volume.get("projected", {}).get("sources", [])
        if "secret" in volume:
            sources = [{"secret": {"name": volume["secret"]["secretName"]}}]
        for source in sources:
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in source:
                    items = source[key].get("items", [])
                    wanted = refs.setdefault((kind, source[key]["name"]), set())
                    wanted.update(item["key"] for item in items)
    return refs
