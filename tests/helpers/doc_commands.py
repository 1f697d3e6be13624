"""The marked steps of docs/operations.md, and a runner that carries them out as the parties the
document addresses (tests/test_operations_doc.py).

A mark is an HTML comment on its own line (invisible when the Markdown is rendered):

* ``<!-- variables -->`` before the ```` ```sh ```` block that assigns the shell variables the
  other blocks use;
* ``<!-- run: PARTY -->`` before a ```` ```sh ```` block: PARTY runs it, verbatim, in its shell
  (``site``: every site does);
* ``<!-- start: PARTY -->`` before a block holding one command: PARTY starts it as a daemon;
* ``<!-- edit: PARTY FILE -->`` before a ```` ```toml ```` block: PARTY appends those tables to
  FILE (which must stay valid TOML: no table the file already has); ``<!-- edit: PARTY FILE
  [table] -->``: PARTY changes those keys inside FILE's existing ``[table]``;
* ``<!-- move: PARTY SRC -> PARTY DST -->``: a file or folder sent from one party to another
  (``DST`` ending in ``/`` is a folder to put it in);
* ``<!-- wait: site -->``: the site daemons started so far have exited.

``$NAME`` in FILE, SRC, DST and TOML blocks is the party's shell variable. Every party has its own
working folder and variables; variables a block exports stay set for that party's next blocks,
as in one terminal session. Nothing here measures time: daemons get generous limits and a failure
carries the command's output or the daemon's log.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import string
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afl.server import toml_text

__all__ = [
    "Party",
    "Step",
    "StepRunner",
    "doc_steps",
    "edit_target",
    "used_variables",
    "variables_block",
]

KINDS = ("run", "start", "edit", "move", "wait", "variables")
PARTIES = ("operator", "coordinator", "site")
_MARK = re.compile(r"^<!-- (\w+):? ?(.*?) -->$")
_VARIABLE = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)")
_SHELL_NOISE = {"_", "SHLVL", "PWD", "OLDPWD", "__DOC_ENV"}


@dataclass(frozen=True)
class Step:
    """One marked step: ``kind`` (KINDS), ``party``, ``argument`` (edit: the file; move: "SRC ->
    PARTY DST"), ``body`` (the fenced block, if any) and its line in the document."""

    kind: str
    party: str
    argument: str
    body: str
    line: int
    document: str = "docs/operations.md"

    def where(self) -> str:
        return f"{self.document}:{self.line} ({self.kind}: {self.party} {self.argument})"


def doc_steps(text: str, *, document: str = "docs/operations.md") -> list[Step]:
    """Every marked step of the document, in order; ValueError naming the line of a bad mark."""
    lines = text.splitlines()
    steps = []
    for i, raw in enumerate(lines):
        match = _MARK.match(raw.strip())
        if not match or match[1] not in KINDS:
            continue
        kind, rest = match[1], match[2].strip()
        party, _, argument = rest.partition(" ")
        if kind != "variables" and party not in PARTIES:
            raise ValueError(f"line {i + 1}: unknown party {party!r} in {raw.strip()!r}")
        body = ""
        if kind in ("run", "start", "edit", "variables"):
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j >= len(lines) or not lines[j].strip().startswith("```"):
                raise ValueError(f"line {i + 1}: {kind} mark without a fenced block after it")
            end = next(k for k in range(j + 1, len(lines)) if lines[k].strip() == "```")
            body = "\n".join(lines[j + 1 : end]) + "\n"
        steps.append(Step(kind, party, argument.strip(), body, i + 1, document))
    return steps


def edit_target(step: Step) -> tuple[str, tuple[str, ...]]:
    """An edit mark's file and, for ``FILE [table.sub]``, the table its keys go into."""
    target, _, table = step.argument.partition(" ")
    table = table.strip()
    if not table:
        return target, ()
    if not (table.startswith("[") and table.endswith("]")):
        raise ValueError(f"{step.where()}: expected 'FILE [table]', got {step.argument!r}")
    return target, tuple(table[1:-1].split("."))


def variables_block(steps: list[Step]) -> set[str]:
    """The names the ``variables`` block assigns."""
    (block,) = [s for s in steps if s.kind == "variables"]
    return set(re.findall(r"(?m)^(?:export )?([A-Z_][A-Z0-9_]*)=", block.body))


def used_variables(step: Step) -> set[str]:
    return set(_VARIABLE.findall(step.body + " " + step.argument))


@dataclass
class Party:
    """A machine of the document: its working folder, shell variables and terminal input."""

    name: str
    cwd: Path
    env: dict[str, str]
    stdin: str = ""
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _expand(text: str, env: Mapping[str, str]) -> str:
    return string.Template(text).substitute(env)


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"nothing listens on {host}:{port} after 180 s:\n{log.read_text()}")


def _afl_server_address(party: Party) -> tuple[str, int] | None:
    if party.name != "coordinator":
        return None
    return party.env["AFL_HOST"], int(party.env["AFL_PORT"])


class StepRunner:
    """Carries out the steps for one operator, one coordinator and several sites.

    ``on_output(step, party, output)`` sees what every ``run`` block printed (the test reads the
    published roster fingerprint from it, as the operator does). ``listens(party)``: where a
    daemon the party starts listens, waited for before the next step (default: the coordinator's
    ``$AFL_HOST:$AFL_PORT``; None: nothing to wait for)."""

    def __init__(
        self,
        parties: Mapping[str, Party],
        *,
        logs: Path,
        on_output: Callable[[Step, Party, str], None] | None = None,
        listens: Callable[[Party], tuple[str, int] | None] | None = None,
    ) -> None:
        self.listens = listens or _afl_server_address
        self.parties = dict(parties)
        self.logs = logs
        self.on_output = on_output
        self.outputs: list[tuple[Step, str, str]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def sites(self) -> list[Party]:
        return [p for p in self.parties.values() if p.name not in ("operator", "coordinator")]

    def of(self, role: str) -> list[Party]:
        return self.sites() if role == "site" else [self.parties[role]]

    def execute(self, step: Step) -> None:
        if step.kind == "variables":
            return
        if step.kind == "move":
            self._move(step)
            return
        for party in self.of(step.party):
            getattr(self, f"_{step.kind}")(step, party)

    def _run(self, step: Step, party: Party) -> None:
        env_file = self.logs / f"{party.name}.env"
        script = "trap 'env -0 > \"$__DOC_ENV\"' EXIT\n" + step.body
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=party.cwd,
            env={**party.env, "__DOC_ENV": str(env_file)},
            input=party.stdin.encode(),
            capture_output=True,
            timeout=900,
        )
        output = (result.stdout + result.stderr).decode(errors="replace")
        assert result.returncode == 0, (
            f"{step.where()} failed for {party.name} (exit {result.returncode}):\n"
            f"{step.body}\n{output}"
        )
        for item in env_file.read_bytes().split(b"\0"):
            name, sep, value = item.decode().partition("=")
            if sep and name not in _SHELL_NOISE:
                party.env[name] = value
        self.outputs.append((step, party.name, output))
        if self.on_output is not None:
            self.on_output(step, party, output)

    def _start(self, step: Step, party: Party) -> None:
        command = step.body.replace("\\\n", " ").strip()
        assert "\n" not in command, f"{step.where()}: a daemon block holds one command"
        log = self.logs / f"{party.name}-daemon-{len(party.daemons)}.log"
        handle = log.open("wb")
        party.daemons.append(
            subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=party.cwd,
                env={**party.env, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        )
        handle.close()
        if (address := self.listens(party)) is not None:
            _wait_listening(*address, party.daemons[-1], log)

    def _wait(self, step: Step, party: Party) -> None:
        for i, proc in enumerate(party.daemons):
            log = self.logs / f"{party.name}-daemon-{i}.log"
            try:
                code = proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{party.name}'s daemon still runs:\n{log.read_text()}"
                ) from None
            assert code == 0, f"{step.where()}: {party.name} exited {code}:\n{log.read_text()}"

    def _edit(self, step: Step, party: Party) -> None:
        target, table = edit_target(step)
        path = party.cwd / _expand(target, party.env)
        body = _expand(step.body, party.env)
        path.parent.mkdir(parents=True, exist_ok=True)  # a person creates a file not there yet
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        update = tomllib.loads(body)
        if table:  # keys to change inside a table the file already has
            doc = tomllib.loads(text)
            assert isinstance(doc.get(table[0]), dict), (
                f"{step.where()}: {path} has no [{table[0]}] table to edit"
            )
            for name in reversed(table):
                update = {name: update}
        else:  # appended as shown: the document's TOML must not repeat a table the file has
            try:
                tomllib.loads(text + "\n" + body)
            except tomllib.TOMLDecodeError as exc:
                raise AssertionError(
                    f"{step.where()}: appending the block as shown breaks {path}: {exc}"
                ) from None
            doc = tomllib.loads(text)
        _merge(doc, update)
        path.write_text(toml_text.dumps(doc), encoding="utf-8")

    def _move(self, step: Step) -> None:
        source, arrow, target = step.argument.partition(" -> ")
        assert arrow, f"{step.where()}: a move reads 'PARTY SRC -> PARTY DST'"
        to_role, _, destination = target.strip().partition(" ")
        senders = self.of(step.party)
        receivers = self.of(to_role)
        pairs: Iterator[tuple[Party, Party]]
        if step.party == "site" or to_role != "site":
            pairs = ((s, r) for s in senders for r in receivers)
        else:  # to each site its own: $SITE on the sender's side names the receiver
            pairs = ((senders[0], r) for r in receivers)
        for sender, receiver in pairs:
            env = {**sender.env, **receiver.env} if to_role == "site" else dict(sender.env)
            src = _expand(source.strip(), env)
            dst = _expand(destination.strip(), {**receiver.env, **env})
            matches = [Path(m) for m in sorted(glob.glob(os.path.join(sender.cwd, src)))]
            assert matches, f"{step.where()}: {sender.name} has no {src}"
            for item in matches:
                goal = receiver.cwd / dst
                if dst.endswith("/"):
                    goal.mkdir(parents=True, exist_ok=True)
                    goal = goal / item.name
                if item.is_dir():
                    shutil.copytree(item, goal)
                else:
                    shutil.copyfile(item, goal)

    def stop(self) -> dict[str, list[int]]:
        """SIGTERM every daemon still running; their exit codes per party."""
        codes: dict[str, list[int]] = {}
        for party in self.parties.values():
            for proc in party.daemons:
                if proc.poll() is None:
                    proc.terminate()
                try:
                    codes.setdefault(party.name, []).append(proc.wait(timeout=60))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes.setdefault(party.name, []).append(proc.wait())
        return codes


def base_environment() -> dict[str, str]:
    """The test's own environment for the parties' shells (PATH finds the afl commands)."""
    keep = ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV"]
    keep += ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"]  # tests/conftest.py
    return {k: os.environ[k] for k in keep if k in os.environ}
