"""Files deleted so that their bytes do not stay behind (afl.core.erase, docs/protocol.md M-175),
and the background eraser the coordinator hands a finished run's payload files to (M-140).

A hard link made before the erasure keeps the inode readable after the unlink: it shows the
bytes were overwritten, not only the name removed."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

from afl.core import erase
from afl.core.erase import Eraser, erase_file
from tests.helpers.erasing import refuse_erasing


def _file(folder: Path, name: str, data: bytes) -> tuple[Path, Path]:
    """A file and a hard link to it outside what is erased."""
    path = folder / name
    path.write_bytes(data)
    witness = folder / f"{name}.link"
    os.link(path, witness)
    return path, witness


@pytest.mark.parametrize("evidence", [True, False])
def test_erase_file_overwrites_the_bytes_before_it_unlinks(tmp_path: Path, evidence: bool) -> None:
    data = os.urandom(3 * (1 << 20) + 17)  # more than one block
    path, witness = _file(tmp_path, "payload.bin", data)
    found = erase_file(path, evidence=evidence)
    assert not path.exists()
    assert witness.read_bytes() == bytes(len(data))  # the inode holds zeros only
    assert found["size"] == len(data)
    assert found["sha256"] == (hashlib.sha256(data).hexdigest() if evidence else "")


def test_erase_file_unlinks_a_symbolic_link_and_leaves_its_target(tmp_path: Path) -> None:
    target = tmp_path / "target.bin"
    target.write_bytes(b"kept")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    assert erase_file(link) == {"path": str(link), "sha256": "", "size": 0}
    assert not link.is_symlink() and target.read_bytes() == b"kept"


def test_the_eraser_erases_in_order_and_tidies_after_each_batch(tmp_path: Path) -> None:
    batches = [
        [_file(tmp_path, f"b{b}-f{i}", os.urandom(1000 + i)) for i in range(3)] for b in range(3)
    ]
    seen: list[tuple[int, list[bool]]] = []
    eraser = Eraser()
    for b, batch in enumerate(batches):
        paths = [p for p, _ in batch]
        # ``then`` runs after its batch: every later batch is still there.
        eraser.submit(
            paths,
            then=lambda b=b, paths=paths: seen.append(  # type: ignore[misc]
                (b, [p.exists() for bb in batches[b:] for p, _ in bb])
            ),
        )
    assert eraser.drain(timeout_s=60)
    assert [b for b, _ in seen] == [0, 1, 2]
    for b, exists in seen:
        assert exists == [False] * 3 + [True] * (3 * (2 - b)), b
    for batch in batches:
        for path, witness in batch:
            assert not path.exists() and set(witness.read_bytes()) == {0}
    eraser.close()


def test_submit_returns_before_the_disk_is_touched_and_drain_waits(tmp_path: Path) -> None:
    path, witness = _file(tmp_path, "payload.bin", b"statistics")
    gate = threading.Event()

    def hold() -> None:  # the thread is busy until the gate opens
        gate.wait()

    eraser = Eraser()
    eraser.submit([], then=hold)
    eraser.submit([path])
    assert path.exists()  # handed over, not erased yet
    assert eraser.drain(timeout_s=0.2) is False
    gate.set()
    assert eraser.drain(timeout_s=60)
    assert not path.exists() and witness.read_bytes() == bytes(len(b"statistics"))
    eraser.close()


def test_a_file_that_cannot_be_erased_is_logged_and_the_rest_erased(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "a-folder"  # open("r+b") on a folder fails
    folder.mkdir()
    gone = tmp_path / "gone.bin"  # already deleted: skipped without a word
    path, witness = _file(tmp_path, "payload.bin", b"x" * 100)
    failing_then = [False]

    def then() -> None:
        failing_then[0] = True
        raise OSError("tidying failed")

    eraser = Eraser()
    with caplog.at_level(logging.WARNING, logger=erase.__name__):
        eraser.submit([folder, gone, path], then=then)
        eraser.submit([])  # the thread survives both failures
        assert eraser.drain(timeout_s=60)
    assert folder.is_dir() and not path.exists() and witness.read_bytes() == bytes(100)
    assert failing_then[0]
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not erase" in m and str(folder) in m for m in messages), messages
    assert eraser.retry_failed() == 1  # the folder, kept for another try
    assert any("could not tidy up" in m for m in messages), messages
    assert not any(str(gone) in m for m in messages)
    eraser.close()


def test_a_file_that_could_not_be_erased_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, witness = _file(tmp_path, "payload.bin", b"y" * 64)
    broken = refuse_erasing(monkeypatch)
    eraser = Eraser()
    eraser.submit([path])
    assert eraser.drain(timeout_s=60) and path.exists()
    broken[0] = False
    assert eraser.retry_failed() == 1
    assert eraser.drain(timeout_s=60) and not path.exists()
    assert witness.read_bytes() == bytes(64)
    assert eraser.retry_failed() == 0  # nothing left to try
    eraser.close()
    eraser.close()  # a second close returns at once
    assert eraser.drain(timeout_s=60)


def test_close_erases_what_was_handed_over_then_refuses_more(tmp_path: Path) -> None:
    paths = [_file(tmp_path, f"f{i}", os.urandom(5000))[0] for i in range(5)]
    eraser = Eraser()
    eraser.submit(paths)
    eraser.close()
    assert not any(p.exists() for p in paths)
    with pytest.raises(RuntimeError, match="closed"):
        eraser.submit(paths)
    Eraser().close()  # never started: nothing to wait for
