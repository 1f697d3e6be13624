"""An ``afl-server`` with one fault, for the restart and fallback tests.

Usage: ``python faulty_server.py POINT RUN_ID <afl-server arguments>``. The server kills itself
(SIGKILL) right after something is COMMITTED to the store, the most fragile moment for whatever
it holds only in memory, when POINT is

* ``ROUND_STAGE_<NAME>``: the first time a round of RUN_ID enters that stage;
* ``evaluation-ROUND_STAGE_<NAME>``: the same, for RUN_ID's evaluation round (``evaluate =
  true``) only;
* ``evaluation-stored``: once RUN_ID's signed evaluation is stored (before its round is
  PUBLISHED);
* ``upload:N``: once the N-th payload of RUN_ID's rounds is stored;
* ``decryption``: once the decryptor's first signed outcome of RUN_ID is journaled;

with POINT ``disk-full`` the RUN_ID argument is a flag file: while it exists, writing a payload
fails with ENOSPC (a full disk; the rest of the state folder stays writable); with POINT
``purge`` it dies between the commit that marks RUN_ID's payloads purged and their first unlink;
with POINT ``no-watch-rounds`` (RUN_ID ignored) it answers ``WatchRounds`` UNIMPLEMENTED,
like a server without round streams; with POINT ``copy-then-fail:FOLDER`` it copies its state to FOLDER
(:func:`afl.server.store.backup_state`, as ``afl-server backup`` does) right before it stores the
first upload of RUN_ID, and the solve of every round of RUN_ID fails (the round aborts after
every upload arrived, as with a tampered model: nothing is published); and with POINT ``no-unmask-audit`` it skips its own history audit before unmasking (M-124), as a
coordinator that would unmask a drop-out's difference; with POINT ``no-history-audit`` it skips
that audit at submission, at plan time and before unmasking (a coordinator that runs whatever it is asked). The faults are injected here, around the real daemon, so no
product code path knows them.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server import runs as runs_module
from afl.server import store as store_module
from afl.server.daemon import main as daemon
from afl.server.modes import context as mode_context
from afl.server.plan import open as plan_open
from afl.server.rounds import RoundMachine
from afl.server.servicer import CoordinatorServicer
from afl.server.solve.publish import SolveFailed, Solver
from afl.server.store import Store, backup_state


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _run_of(store: Store, round_id: str) -> str:
    return next((r.run_id for r in store.rounds() if r.round_id == round_id), "")


def install(point: str, run_id: str) -> None:
    """Patch :class:`Store` so that the process dies at ``point`` of ``run_id``."""
    if point.removeprefix("evaluation-").startswith("ROUND_STAGE_"):
        stage = pb.RoundStage.Value(point.removeprefix("evaluation-"))
        prefix = "e" if point.startswith("evaluation-") else ""  # evaluation rounds: e<n>-…
        update_round = Store.update_round

        def patched_update_round(self: Store, round_id: str, **kw: Any) -> None:
            update_round(self, round_id, **kw)
            if (
                kw.get("stage") == stage
                and round_id.startswith(prefix)
                and _run_of(self, round_id) == run_id
            ):
                _kill()

        Store.update_round = patched_update_round  # type: ignore[method-assign]
    elif point == "evaluation-stored":
        put_evaluation = Store.put_evaluation

        def patched_put_evaluation(self: Store, round_id: str, **kw: Any) -> str:
            digest = put_evaluation(self, round_id, **kw)
            if _run_of(self, round_id) == run_id:
                _kill()
            return digest

        Store.put_evaluation = patched_put_evaluation  # type: ignore[method-assign]
    elif point.startswith("upload:"):
        target, seen = int(point.split(":")[1]), [0]
        put_upload = Store.put_upload

        def patched_put_upload(self: Store, round_id: str, *args: Any, **kw: Any) -> Any:
            row = put_upload(self, round_id, *args, **kw)
            if _run_of(self, round_id) == run_id:
                seen[0] += 1
                if seen[0] == target:
                    _kill()
            return row

        Store.put_upload = patched_put_upload  # type: ignore[method-assign]
    elif point == "disk-full":
        flag, write = Path(run_id), getattr(store_module, "write_private_file")  # noqa: B009

        def full_disk_write(path: Path, data: bytes) -> Path:
            if "payloads" in Path(path).parts and flag.exists():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return Path(write(path, data))

        setattr(store_module, "write_private_file", full_disk_write)  # noqa: B010
    elif point == "purge":
        purge, unlink = Store.purge_payloads, Path.unlink

        def patched_purge(self: Store, round_ids: Any, *, audit: Any = None) -> int:
            if not any(_run_of(self, r) == run_id for r in round_ids):
                return purge(self, round_ids, audit=audit)

            def killed_unlink(path: Path, missing_ok: bool = False) -> None:
                if "payloads" in path.parts:
                    _kill()
                unlink(path, missing_ok=missing_ok)

            setattr(Path, "unlink", killed_unlink)  # noqa: B010
            return purge(self, round_ids, audit=audit)

        Store.purge_payloads = patched_purge  # type: ignore[method-assign]
    elif point == "no-watch-rounds":

        def unimplemented(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no round streams on this server")

        CoordinatorServicer.WatchRounds = unimplemented  # type: ignore[method-assign]
    elif point == "decryption":
        put_message = Store.put_message

        def patched_put_message(self: Store, round_id: str, **kw: Any) -> None:
            put_message(self, round_id, **kw)
            if str(kw.get("kind", "")).startswith("ckks-outcome") and (
                _run_of(self, round_id) == run_id
            ):
                _kill()

        Store.put_message = patched_put_message  # type: ignore[method-assign]
    elif point.startswith("copy-then-fail:"):
        folder, put, solve = Path(point.split(":", 1)[1]), Store.put_upload, Solver.solve

        def copying_put_upload(self: Store, round_id: str, *args: Any, **kw: Any) -> Any:
            if _run_of(self, round_id) == run_id and not folder.exists():
                backup_state(self.state_dir, folder)
            return put(self, round_id, *args, **kw)

        def failing_solve(self: Solver, view: Any, run: Any) -> Any:
            if run.run_id == run_id:
                return SolveFailed("solve failed: a fault injected after the uploads")
            return solve(self, view, run)

        Store.put_upload = copying_put_upload  # type: ignore[method-assign]
        Solver.solve = failing_solve  # type: ignore[method-assign]
    elif point == "no-unmask-audit":
        RoundMachine.exposes_history = lambda self, *a, **kw: ""  # type: ignore[method-assign]
    elif point == "no-history-audit":
        RoundMachine.exposes_history = lambda self, *a, **kw: ""  # type: ignore[method-assign]
        for module in (plan_open, mode_context):  # the name each imported
            setattr(module, "history_audit", lambda *a, **kw: ("", None))  # noqa: B010
        setattr(runs_module, "submission_audit", lambda *a, **kw: ("", None))  # noqa: B010
    else:
        raise SystemExit(f"unknown crash point {point!r}")


if __name__ == "__main__":
    install(sys.argv[1], sys.argv[2])
    sys.exit(daemon.main(sys.argv[3:]))
