"""Validation of deploy/ with the tools available here (Docker may not run):

* compose.yaml: parsed by a small block-YAML reader (the subset compose.yaml uses; cross-checked
  against PyYAML when it is installed) and checked structurally;
* Dockerfiles: a small lint (FROM first, pinned tags, no ADD of URLs, non-root USER, exec-form
  ENTRYPOINT/CMD, COPY sources that exist);
* systemd units: `systemd-analyze verify` when available;
* example TOMLs: loaded by the real loaders (paths and keys substituted by a provisioned kit's);
* the daemons started from the units' ExecStart lines verbatim (paths substituted) with the example
  configs: the server serves gRPC health and metrics and stops on SIGTERM; three clients complete
  a round against it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from afl.client.config import load_client_config
from afl.ops.provisioning import ProvisionedFederation
from afl.server.config import load_config, round_template
from tests.helpers.caches import write_surrogate_cache
from tests.helpers.federation import FederationSpec

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = ["Dockerfile.server", "Dockerfile.client", "Dockerfile.client-cuda"]
SITES = ["site-1", "site-2", "site-3"]
#: The backbone id the examples name: the one `afl-client extract` stamps (afl.client.features.backbones).
EXAMPLE_BACKBONE = "xrv-densenet121-all"
PLACEHOLDER_KEYS = {
    "server": "5e" * 32,
    "site-1": "51" * 32,
    "site-2": "52" * 32,
    "site-3": "53" * 32,
}
BIN = Path(sys.executable).parent
FEDERATION = FederationSpec(sites=SITES, federation_id="fed-example")


# --- a reader for the block-YAML subset of compose.yaml -------------------------------------------


def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return json.loads(text)  # flow lists in compose.yaml are written as JSON arrays
    if text[:1] in "\"'":
        return json.loads(text) if text[0] == '"' else text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "null": None}.get(text, text)


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] == " "):
            return line[:i].rstrip()
    return line.rstrip()


def parse_block_yaml(text: str) -> Any:
    """Mappings, lists of scalars and scalars in block style; raises ValueError otherwise."""
    lines = [
        (len(s) - len(s.lstrip(" ")), s.strip()) for s in map(_strip_comment, text.split("\n"))
    ]
    lines = [(indent, s) for indent, s in lines if s]
    if any("\t" in s or s.startswith(("&", "*", "<<")) or " &" in s for _, s in lines):
        raise ValueError("tabs, anchors and merge keys are outside the supported subset")

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][1].startswith("- "):
            items = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                items.append(_scalar(lines[i][1][2:]))
                i += 1
            return items, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][0] == indent:
            key, sep, rest = lines[i][1].partition(":")
            if not sep or key in mapping:
                raise ValueError(f"bad or duplicate key in line {lines[i][1]!r}")
            if rest.strip():
                mapping[key] = _scalar(rest)
                i += 1
            elif i + 1 < len(lines) and lines[i + 1][0] > indent:
                mapping[key], i = block(i + 1, lines[i + 1][0])
            else:
                mapping[key], i = None, i + 1
        if i < len(lines) and lines[i][0] > indent:
            raise ValueError(f"unexpected indentation at {lines[i][1]!r}")
        return mapping, i

    value, end = block(0, 0)
    if end != len(lines):
        raise ValueError(f"unparsed line {lines[end][1]!r}")
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = parse_block_yaml((DEPLOY / "compose.yaml").read_text())
    try:
        yaml = importlib.import_module("yaml")  # PyYAML, when installed: cross-check the reader
    except ImportError:
        return dict(doc)
    assert yaml.safe_load((DEPLOY / "compose.yaml").read_text()) == doc
    return dict(doc)


def test_block_yaml_reader_on_a_known_document() -> None:
    text = 'a:\n  b: 1 # c\n  l:\n    - "x: y"\n    - z\nd: ["p", "q"]\ne:\n'
    assert parse_block_yaml(text) == {"a": {"b": 1, "l": ["x: y", "z"]}, "d": ["p", "q"], "e": None}
    with pytest.raises(ValueError):
        parse_block_yaml("a: 1\na: 2\n")


def test_compose_is_a_three_site_federation(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"afl-server", *SITES}
    server = services["afl-server"]
    assert (DEPLOY / server["build"]["context"] / server["build"]["dockerfile"]).is_file()
    assert server["volumes"] == ["./kits/server:/var/lib/afl"]
    assert server["command"][:2] == ["--config", "/var/lib/afl/server.toml"]
    assert all(p.startswith("127.0.0.1:") for p in server["ports"])
    for site in SITES:
        svc = services[site]
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert f"./kits/sites/{site}:/var/lib/afl" in svc["volumes"]
        assert f"./data/{site}:/data:ro" in svc["volumes"]
        assert svc["depends_on"]["afl-server"]["condition"] == "service_healthy"
        assert svc["command"] == ["run", "--config", "/var/lib/afl/client.toml"]
    for svc in services.values():
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in svc["security_opt"]
        assert not svc["user"].startswith(("0:", "root")), "containers must not run as root"
        assert svc["networks"] == ["federation"]
    assert "federation" in compose["networks"]


# --- Dockerfiles ------------------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _package_folders() -> set[str]:
    """The top-level folders pyproject.toml's package-dir maps into the afl package."""
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder.split("/")[0] for folder in dirs.values()}


def lint_dockerfile(path: Path) -> list[str]:
    """Problems found by the checks named in the module docstring (empty when clean)."""
    problems = []
    steps = _instructions(path)
    defaults: dict[str, str] = {}  # ARGs before the first FROM (they parameterise FROM only)
    while steps and steps[0][0] == "ARG":
        name, _, default = steps.pop(0)[1].partition("=")
        defaults[name.strip()] = default.strip().strip('"')
    if not steps or steps[0][0] != "FROM":
        problems.append("the first instruction must be FROM")
    for word, rest in steps:
        if word == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m[1], ""), rest.split()[0])
            tag = image.rpartition(":")[2] if ":" in image.split("/")[-1] else ""
            if not tag or tag == "latest":
                problems.append(f"FROM {image}: pin an explicit tag (not latest)")
        if word == "ADD" and re.search(r"\bhttps?://", rest):
            problems.append("ADD of a URL: download in RUN with a checksum instead")
        if word in ("ENTRYPOINT", "CMD") and not rest.startswith("["):
            problems.append(f"{word} must use the exec (JSON) form")
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                if not (ROOT / source).exists():
                    problems.append(f"COPY source {source} does not exist in the repository")
    copied = {rest.split()[0] for word, rest in steps if word == "COPY"}
    missing = sorted(_package_folders() - copied)
    installs = any(word == "RUN" and "pip install" in rest and " ." in rest for word, rest in steps)
    if installs and missing:
        problems.append(f"pip install . without COPY of the package folders {missing}")
    users = [rest for word, rest in steps if word == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image must switch to a non-root USER")
    return problems


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_pass_the_lint(name: str) -> None:
    assert lint_dockerfile(DEPLOY / name) == []
    assert (DEPLOY / f"{name}.dockerignore").is_file()


def test_the_lint_catches_bad_dockerfiles(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("RUN true\nFROM python:latest\nADD https://x.org/a.tgz /\nCMD afl-server\n")
    problems = " | ".join(lint_dockerfile(bad))
    for expected in ("first instruction", "latest", "ADD of a URL", "exec", "non-root"):
        assert expected in problems
    # A base image from a build argument is judged by its default; every package folder is copied.
    bad.write_text(
        "ARG BASE_IMAGE=python:latest\nFROM ${BASE_IMAGE}\nCOPY core ./core\n"
        "RUN pip install . && true\nUSER afl\n"
    )
    problems = " | ".join(lint_dockerfile(bad))
    assert "FROM python:latest" in problems and "'ops'" in problems and "'server'" in problems


# --- systemd units ----------------------------------------------------------------------------------


def _exec_start(unit: Path) -> list[str]:
    lines = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    assert len(lines) == 1
    return shlex.split(lines[0].removeprefix("ExecStart="))


@pytest.mark.parametrize(
    ("unit", "instance"), [("afl-server.service", None), ("afl-client@.service", "site-1")]
)
def test_units_are_hardened_and_verify(unit: str, instance: str | None, tmp_path: Path) -> None:
    text = (DEPLOY / unit).read_text()
    for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ReadWritePaths=", "User=afl"):
        assert option in text
    assert "StateDirectory=" in text and "CapabilityBoundingSet=" in text
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    # The unit as installed, with ExecStart's binary pointing at this venv (verify checks it exists).
    program = _exec_start(DEPLOY / unit)[0]
    name = unit.replace("@", f"@{instance}") if instance else unit
    (tmp_path / name).write_text(text.replace(program, str(BIN / Path(program).name)))
    result = subprocess.run(
        [tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# --- example configs, rendered onto a provisioned kit -----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kit_keys(fed: ProvisionedFederation) -> dict[str, str]:
    import tomllib

    server = tomllib.loads((fed.server_dir / "server.toml").read_text())
    keys = {"server": server["identity"]["public_key"]}
    keys.update({s: server["sites"][s]["identity_public_key"] for s in SITES})
    return keys


def render(example: str, fed: ProvisionedFederation, tmp: Path, *, site: str = "site-1") -> str:
    """The example text with its systemd paths and placeholder keys replaced by the kit's."""
    text = (DEPLOY / example).read_text()
    own = f'public_key = "{PLACEHOLDER_KEYS["site-1"]}"'
    text = text.replace(own, f'public_key = "{PLACEHOLDER_KEYS[site]}"')
    for who, real in _kit_keys(fed).items():
        text = text.replace(PLACEHOLDER_KEYS[who], real)
    if example.startswith("client"):
        text = text.replace('"site-1"', f'"{site}"').replace("/site-1", f"/{site}")
    return (
        text.replace("/etc/afl/server", str(fed.server_dir))
        .replace(f"/etc/afl/sites/{site}", str(fed.site_dirs[site]))
        .replace("/var/lib/afl-server", str(tmp / "server-state"))
        .replace(f"/var/lib/afl-client/{site}", str(tmp / f"{site}-state"))
        .replace(f"/srv/afl/{site}/cache", str(tmp / "data" / site))
    )


def test_example_configs_load_with_the_real_loaders(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    server_path = tmp_path / "server.toml"
    server_path.write_text(render("server.example.toml", federation, tmp_path))
    config = load_config(server_path)
    assert config.round.feature_dim == 1024 and set(config.sites) == {*SITES, "decryptor"}
    text = (DEPLOY / "server.example.toml").read_text()
    for key in [
        *round_template(),
        "federation_id",
        "listen",
        "state_dir",
        "metrics_port",
        "metrics_address",
    ]:
        assert re.search(rf"^{key} = ", text, re.M), f"server.example.toml lacks {key}"
    # Both examples name the backbone id the extractor stamps into a cache (a server using the
    # example must accept the sites' caches), and it is a registered backbone.
    from afl.client.features.backbones import BACKBONES

    client_text = (DEPLOY / "client.example.toml").read_text()
    named = {m for t in (text, client_text) for m in re.findall(r'^backbone = "(.*)"$', t, re.M)}
    assert named == {EXAMPLE_BACKBONE} and EXAMPLE_BACKBONE in BACKBONES
    assert config.round.backbone == EXAMPLE_BACKBONE
    client_path = tmp_path / "client.toml"
    client_path.write_text(render("client.example.toml", federation, tmp_path))
    client = load_client_config(client_path)
    assert client.warnings == () and client.site_id == "site-1" and len(client.peers) == 4
    assert client.policy.allowed_aggregation == ("mask", "ckks")
    from afl.client.config import _KNOWN

    text = (DEPLOY / "client.example.toml").read_text()
    for keys in _KNOWN.values():
        for key in keys - {"cache_dir"}:
            assert re.search(rf"^{key} = ", text, re.M), f"client.example.toml lacks {key}"
    for example in ("server.example.toml", "client.example.toml"):
        lines = (DEPLOY / example).read_text().splitlines()
        seen: set[str] = set()
        for i, line in enumerate(lines):  # every option is documented where it first appears
            option = re.match(r"^([a-z_]+) = ", line)
            if option and option[1] not in seen:
                seen.add(option[1])
                assert lines[i - 1].startswith("#"), f"{example}: {line!r} has no comment"


# --- daemons started from the units -----------------------------------------------------------------


def _command(unit: str, config: Path, instance: str = "") -> list[str]:
    argv = [a.replace("%i", instance) for a in _exec_start(DEPLOY / unit)]
    program = BIN / Path(argv[0]).name
    assert program.is_file(), f"{program} is not installed in this venv"
    return [str(program), *argv[1:-1], str(config)]


def _health(port: int, fed: ProvisionedFederation) -> int:
    kit = fed.site_dirs["site-1"]
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(kit / "ca.pem").read_bytes(),
        private_key=(kit / "site.key").read_bytes(),
        certificate_chain=(kit / "site.pem").read_bytes(),
    )
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return int(reply.status)


def _start_server(fed: ProvisionedFederation, tmp: Path, **round_overrides: Any) -> tuple[Any, int]:
    port, metrics = _free_port(), _free_port()
    text = render("server.example.toml", fed, tmp)
    text = text.replace('listen = "0.0.0.0:50051"', f'listen = "127.0.0.1:{port}"')
    text = text.replace("metrics_port = 9100", f"metrics_port = {metrics}")
    for key, value in round_overrides.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {json.dumps(value)}", text, flags=re.M)
    config = tmp / "server.toml"
    config.write_text(text)
    log = (tmp / "server.log").open("w")  # a file, so a full pipe never blocks the server
    process = subprocess.Popen(_command("afl-server.service", config), stderr=log)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if "listening on port" in (tmp / "server.log").read_text():
            return process, metrics
        time.sleep(0.1)
    _stop(process)
    raise AssertionError(f"afl-server did not start: {(tmp / 'server.log').read_text()[-2000:]}")


def _stop(process: Any) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return int(process.wait(timeout=30))
    finally:
        if process.poll() is None:
            process.kill()


def test_server_runs_from_its_unit_and_example_config(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    process, metrics = _start_server(federation, tmp_path)
    try:
        port = int(load_config(tmp_path / "server.toml").listen.rsplit(":", 1)[1])
        assert _health(port, federation) == health_pb2.HealthCheckResponse.SERVING
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read()
        assert b"afl_round_stage" in body
    finally:
        assert _stop(process) == 0
    assert (tmp_path / "server-state" / "server.sqlite3").is_file()


def test_three_clients_from_their_unit_complete_a_round(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    d, classes = 16, ["Atelectasis", "Effusion", "Pneumothorax"]
    process, _ = _start_server(
        federation, tmp_path, feature_dim=d, classes=classes, backbone="", enrol_timeout_s=60.0
    )
    port = int(load_config(tmp_path / "server.toml").listen.rsplit(":", 1)[1])
    clients = []
    try:
        rng = np.random.default_rng(8)
        for site in SITES:
            write_surrogate_cache(
                tmp_path / "data" / site, site=site, classes=classes, d=d, rng=rng
            )
            text = render("client.example.toml", federation, tmp_path, site=site)
            replaced = text.replace(f'backbone = "{EXAMPLE_BACKBONE}"', 'backbone = "surrogate"')
            assert replaced != text  # the example's backbone line is the one the test changes
            text = replaced
            text = text.replace("linger_s = 5.0", "linger_s = 1.0")
            served = text.replace("serve = true", "serve = false")  # exit after the round
            assert served != text
            text = served
            text = text.replace("afl.example.org:50051", f"localhost:{port}")
            # The example server runs plaintext: each site opts in explicitly.
            text = text.replace(
                'allowed_aggregation = ["mask", "ckks"]',
                'allowed_aggregation = ["plaintext", "mask", "ckks"]',
            )
            config = tmp_path / f"{site}.toml"
            config.write_text(text)
            clients.append(
                subprocess.Popen(
                    _command("afl-client@.service", config, site),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        for site, client in zip(SITES, clients, strict=True):
            _, err = client.communicate(timeout=300)
            assert client.returncode == 0, f"{site}: {err[-2000:]}"
            reports = list((tmp_path / f"{site}-state" / "reports").glob("*.json"))
            assert reports, f"{site} wrote no report"
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        assert _stop(process) == 0
