"""The coordinator and site images built from deploy/ and a masked federation run in them
(slow: building the images takes minutes).

What runs: deploy/compose.yaml's services, as podman containers. The images are built from the
services' ``build:`` entries (deploy/Dockerfile.server, deploy/Dockerfile.client) on a base image
made from Debian's packages (deploy/images/build-base.sh; no registry is reachable here), with
the Python packages from a local wheelhouse (``pip download`` through this machine's own index)
and no network during the build. The site image is the daemon-only variant (``AFL_EXTRAS=``,
``TORCH_INDEX=``): the sites read surrogate feature caches, so torch is not needed in it. Each
service's compose settings (user, read-only root, tmpfs, dropped capabilities,
no-new-privileges, volumes, command) become ``podman run`` options; compose's bridge network
becomes one network namespace with loopback only (the coordinator's, which the sites join;
``afl-server`` resolves to 127.0.0.1 there), so nothing leaves the machine. The coordinator also
gets the chart's ``--health-port`` and is asked over it, in plaintext, as the kubelet would.

Oracle: the pooled ridge solve in numpy on the sites' caches (tests/helpers/numeric.py).

podman (Debian's package) runs with runc, the cgroupfs cgroup manager and no default ulimits
(a containers.conf passed through CONTAINERS_CONF); the test needs root (rootful podman), and
skips without podman, or without mmdebstrap when the base image is absent.
``AFL_BASE_IMAGE`` names a base image to use instead of building one; ``AFL_WHEELHOUSE`` a
folder to keep the downloaded wheels in between runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from afl.ops.provisioning import provision
from afl.server.toml_text import dumps
from tests.deploy.chart import ROOT, merge
from tests.helpers.caches import write_surrogate_cache
from tests.helpers.numeric import pooled_ridge, relative_error

pytestmark = pytest.mark.slow

DEPLOY = ROOT / "deploy"
SITES = ("site-1", "site-2", "site-3")
CLASSES = ["Atelectasis", "Effusion", "Pneumothorax"]
D = 16
UID = "10001"  # the images' afl user; compose's AFL_UID/AFL_GID
CONTAINERS_CONF = """[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
#: Build arguments of the test's images: the daemon-only site image (no torch).
BUILD_ARGS = {"deploy/Dockerfile.client": {"AFL_EXTRAS": "", "TORCH_INDEX": ""}}
HEALTH_PORT = 8081  # the chart's health.port


def _nice(argv: list[str]) -> list[str]:
    return ["nice", "-n", "10", *argv]


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment podman runs in (CONTAINERS_CONF as the module docstring says)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (Debian: apt-get install podman runc)")
    if os.geteuid() != 0:
        pytest.skip("the image test runs rootful podman (root)")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    yield {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(conf))}


def _run(argv: list[str], env: Mapping[str, str], *, timeout: float = 1800) -> str:
    result = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv[:6])}...: exit {result.returncode}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def _interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ${VAR} and ${VAR:-default}."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1]) or (m[2] or ""), value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    rendered = _interpolate(doc, {"AFL_UID": UID, "AFL_GID": UID})
    assert isinstance(rendered, dict)
    return rendered


@pytest.fixture(scope="module")
def images(
    podman: dict[str, str], compose: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, float]:
    """Builds the base image (when absent) and compose's images; returns seconds per step."""
    timings: dict[str, float] = {}
    base = os.environ.get("AFL_BASE_IMAGE", "localhost/afl-base:bookworm")
    exists = subprocess.run(["podman", "image", "exists", base], env=podman, check=False)
    if exists.returncode != 0:
        if shutil.which("mmdebstrap") is None:
            pytest.skip("no base image and no mmdebstrap to build one (apt-get install mmdebstrap)")
        start = time.monotonic()
        _run(_nice([str(DEPLOY / "images" / "build-base.sh"), base]), podman)
        timings["base image (mmdebstrap + podman import)"] = time.monotonic() - start
    wheels = Path(os.environ.get("AFL_WHEELHOUSE") or tmp_path_factory.mktemp("wheels"))
    start = time.monotonic()
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--dest",
            str(wheels),
            str(ROOT),
            "setuptools>=68",
            "wheel",
        ],
        os.environ,
    )
    timings["wheelhouse (pip download)"] = time.monotonic() - start
    built: set[str] = set()
    for service in compose["services"].values():
        image, build = service["image"], service["build"]
        if image in built:
            continue
        built.add(image)
        dockerfile = build["dockerfile"]
        argv = [
            "podman",
            "build",
            "--quiet",
            "--network",
            "none",
            "--volume",
            f"{wheels}:/wheels:ro",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            "PIP_OPTIONS=--no-index --find-links /wheels",
            "--ignorefile",
            str(ROOT / f"{dockerfile}.dockerignore"),
            "--file",
            str(ROOT / dockerfile),
            "--tag",
            image,
        ]
        for name, value in BUILD_ARGS.get(dockerfile, {}).items():
            argv += ["--build-arg", f"{name}={value}"]
        start = time.monotonic()
        _run(_nice([*argv, str((DEPLOY / build["context"]).resolve())]), podman)
        timings[f"image {image} ({dockerfile})"] = time.monotonic() - start
    print("\nimage build timings (s):", {k: round(v, 1) for k, v in timings.items()})
    return timings


def run_options(service: Mapping[str, Any], project: Path) -> list[str]:
    """A compose service's settings as ``podman run`` options (networks aside)."""
    options = ["--user", service["user"]]
    if service.get("read_only"):
        options.append("--read-only")
    for path in service.get("tmpfs", []):
        options += ["--tmpfs", path]
    for cap in service.get("cap_drop", []):
        options += ["--cap-drop", cap]
    for opt in service.get("security_opt", []):
        options += ["--security-opt", opt.replace("no-new-privileges:true", "no-new-privileges")]
    for volume in service.get("volumes", []):
        source, _, target = volume.partition(":")
        if source.startswith("."):
            source = str((project / source).resolve())
        options += ["--volume", f"{source}:{target}"]
    return options


def test_compose_services_become_the_run_options_the_federation_uses(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """The translation itself (cheap, but in this slow module with the run it serves)."""
    options = run_options(compose["services"]["site-2"], tmp_path)
    assert options[:2] == ["--user", f"{UID}:{UID}"] and "--read-only" in options
    assert options[options.index("--cap-drop") : options.index("--cap-drop") + 2] == [
        "--cap-drop",
        "ALL",
    ]
    assert f"{(tmp_path / 'data/site-2').resolve()}:/data:ro" in options


def _prepare(project: Path) -> None:
    """deploy/compose.yaml's folder layout: kits/ from `afl provision --server-host afl-server`
    completed as its header says, and a feature cache per site in data/."""
    federation = provision(
        project / "kits",
        sites=list(SITES),
        server_hosts=["afl-server"],
        federation_id="fed-containers",
        round_settings={
            "classes": CLASSES,
            "feature_dim": D,
            "aggregation": "mask",
            "enrol_timeout_s": 600.0,
            "upload_timeout_s": 600.0,
        },
    )
    rng = np.random.default_rng(27)
    for site in SITES:
        write_surrogate_cache(project / "data" / site, site=site, classes=CLASSES, d=D, rng=rng)
        config = federation.site_dirs[site] / "client.toml"
        doc = tomllib.loads(config.read_text())
        merge(doc, {"data": {"cache": "/data", "classes": CLASSES}})
        config.write_text(dumps(doc))
    for folder in (project / "kits", project / "data"):
        subprocess.run(["chown", "-R", f"{UID}:{UID}", str(folder)], check=True)


def _logs(name: str, env: Mapping[str, str]) -> str:
    result = subprocess.run(["podman", "logs", name], env=dict(env), capture_output=True, text=True)
    return (result.stdout + result.stderr)[-3000:]


def test_a_masked_federation_completes_in_the_built_containers(
    podman: dict[str, str], compose: dict[str, Any], images: dict[str, float], tmp_path: Path
) -> None:
    project = tmp_path / "deploy"
    _prepare(project)
    services = compose["services"]
    tag = uuid.uuid4().hex[:8]
    names = {service: f"afl-test-{tag}-{service}" for service in services}
    coordinator = names["afl-server"]
    # Compose's network resolves a service by its name; here every container of the federation
    # shares the coordinator's network namespace, and this hosts file names it.
    hosts = project / "hosts"
    hosts.write_text("127.0.0.1 localhost afl-server\n")
    resolve = ["--volume", f"{hosts}:/etc/hosts:ro"]
    started: list[str] = []
    try:
        server = services["afl-server"]
        _run(
            [
                "podman",
                "run",
                "--detach",
                "--name",
                coordinator,
                "--network",
                "none",
                *resolve,
                *run_options(server, project),
                server["image"],
                *server["command"],
                "--health-port",
                str(HEALTH_PORT),
            ],
            podman,
        )
        started.append(coordinator)
        # compose's depends_on: service_healthy, with compose's own health check command.
        check = server["healthcheck"]["test"][1:]  # ["CMD", ...] -> the command
        deadline = time.monotonic() + 600
        while True:
            probe = subprocess.run(
                ["podman", "exec", coordinator, *check], env=podman, capture_output=True
            )
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, f"never healthy:\n{_logs(coordinator, podman)}"
            time.sleep(2)
        for site in SITES:
            spec = services[site]
            _run(
                [
                    "podman",
                    "run",
                    "--detach",
                    "--name",
                    names[site],
                    "--network",
                    f"container:{coordinator}",
                    *resolve,
                    *run_options(spec, project),
                    spec["image"],
                    *spec["command"],
                ],
                podman,
            )
            started.append(names[site])
        for site in SITES:
            code = _run(["podman", "wait", names[site]], podman, timeout=900).strip()
            assert code == "0", f"{site} exited {code}:\n{_logs(names[site], podman)}"
        # The chart's probe path: the plaintext health port, asked as the kubelet asks.
        health = (
            "import grpc; from grpc_health.v1 import health_pb2 as p, health_pb2_grpc as g; "
            f"c = grpc.insecure_channel('127.0.0.1:{HEALTH_PORT}'); "
            "print(p.HealthCheckResponse.ServingStatus.Name(g.HealthStub(c).Check("
            "p.HealthCheckRequest(service='afl.proto.v1.Coordinator'), timeout=10).status))"
        )
        out = _run(["podman", "exec", coordinator, "python", "-c", health], podman)
        assert out.strip() == "SERVING"
        metrics = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
        body = _run(["podman", "exec", coordinator, "python", "-c", metrics], podman)
        assert re.search(r'afl_rounds_total\{outcome="published"\} 1\.0', body), body[-2000:]
        # `afl admin` from the coordinator image (the chart's admin Job runs the same command).
        admin = project / "kits" / "admins" / "operator"
        listing = _run(
            [
                "podman",
                "run",
                "--rm",
                "--network",
                f"container:{coordinator}",
                *resolve,
                "--user",
                f"{UID}:{UID}",
                "--read-only",
                "--cap-drop",
                "ALL",
                "--volume",
                f"{admin}:/etc/afl/admin:ro",
                "--entrypoint",
                "afl",
                services["afl-server"]["image"],
                "admin",
                "--config",
                "/etc/afl/admin/admin.toml",
                "ls",
            ],
            podman,
        )
        assert re.search(r"run-1\s.*published", listing), listing
        # SIGTERM: the coordinator finishes in-flight calls, closes its store and exits 0.
        _run(["podman", "stop", "--time", "60", coordinator], podman, timeout=120)
        state = _run(["podman", "inspect", "--format", "{{.State.ExitCode}}", coordinator], podman)
        assert state.strip() == "0", _logs(coordinator, podman)
    finally:
        for name in reversed(started):
            subprocess.run(["podman", "rm", "--force", name], env=podman, capture_output=True)
    oracle = pooled_ridge([project / "data" / site for site in SITES], classes=CLASSES, gamma=1.0)
    for site in SITES:
        state_dir = project / "kits" / "sites" / site / "state"
        (model,) = list((state_dir / "models").glob("*.weights.npy"))
        assert relative_error(np.load(model), oracle) < 1e-9, site
        (report,) = [p.read_text() for p in (state_dir / "reports").glob("*.json")]
        assert '"outcome": "COMPLETED"' in report
    server_toml = (project / "kits" / "server" / "server.toml").read_text()
    assert 'aggregation = "mask"' in server_toml
