"""The federation log in the coordinator's store (docs/protocol.md §11a, M-190, M-191): one
statement per recorded state change, appended in that change's transaction; append-only; a
restart never shrinks it below a signed checkpoint; the proofs it serves verify under RFC 9162
(the verification written out independently in tests/crypto/transparency/test_merkle.py)."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw, sign_fields
from afl.crypto.transparency.checkpoint import verify_checkpoint
from afl.crypto.transparency.merkle import leaf_hash, verify_consistency, verify_inclusion
from afl.crypto.transparency.statements import (
    DECRYPTING_CONTEXT,
    decode_statement,
    decrypting_signed_fields,
    decrypting_statement,
    plan_statement,
)
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError, NotPermittedError, StateError, WrongStageError
from afl.server.store import DB_NAME, EnrolmentRow, Store
from afl.server.transparency import FederationLog

FED = "fed-log-test"
KEY = generate_identity_key()


def _store(path: Path) -> Store:
    return Store(path, federation_id=FED)


def test_a_state_change_and_its_statement_commit_together_or_not_at_all(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(RuntimeError), store.transaction():
        store.create_run(run_id="run-1", name="a", settings={"x": 1}, submitted_by="op")
        assert store.log_size() == 1  # inside: the statement is there
        raise RuntimeError("crash before commit")
    assert store.log_size() == 0 and store.run_row("run-1") is None
    store.create_run(run_id="run-1", name="a", settings={"x": 1}, submitted_by="op")
    store.update_run("run-1", state="aborted", reason="by admin")
    kinds = [kind for _, kind, _, _ in store.log_entries(0, 10)]
    assert kinds == ["run-submitted", "run-ended"]
    kind, fields = decode_statement(store.log_entries(1, 2)[0][2], federation=FED)
    assert (kind, fields["state"], fields["reason"]) == ("run-ended", "aborted", "by admin")


def test_the_kept_tree_holds_committed_statements_and_a_transaction_sees_its_own(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    committed = store.log_tree().root()
    with pytest.raises(RuntimeError), store.transaction():
        store.create_run(run_id="run-2", name="b", settings={}, submitted_by="op")
        inside = store.log_tree()  # its own statement too, not kept
        assert len(inside) == 2 and inside.root(1) == committed
        raise RuntimeError("crash before commit")
    assert len(store.log_tree()) == 1 and store.log_tree().root() == committed
    store.create_run(run_id="run-3", name="c", settings={}, submitted_by="op")
    leaves = [leaf_hash(entry) for _, _, entry, _ in store.log_entries(0, 10)]
    assert store.log_tree().leaves == leaves  # the rolled-back statement never entered it
    reopened = _store(tmp_path)  # a restart builds the same tree from the database
    assert reopened.log_tree().root() == store.log_tree().root()


def test_the_entries_served_without_the_lock_are_committed_ones_only(tmp_path: Path) -> None:
    """GetLogEntries reads over a connection of its own (FederationLog.entries), so it needs no
    lock: it sees a statement once its transaction committed, never one still open or rolled
    back, from any thread; a closed store answers that it is stopping."""
    import threading

    from afl.server.errors import StoppingError

    store = _store(tmp_path)
    log = FederationLog(store, key=KEY, federation_id=FED)
    store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    seen: list[list[int]] = []

    def read_elsewhere() -> None:  # as a gRPC thread does while another holds the lock
        seen.append([i for i, _, _, _ in log.entries(0, 10)])

    with pytest.raises(RuntimeError), store.transaction():
        store.create_run(run_id="run-2", name="b", settings={}, submitted_by="op")
        assert [i for i, _, _, _ in store.log_entries(0, 10)] == [0, 1]  # the writer's view
        reader = threading.Thread(target=read_elsewhere)
        reader.start()
        reader.join(60)
        assert [i for i, _, _, _ in log.entries(0, 10)] == [0]  # not the open transaction's
        raise RuntimeError("crash before commit")
    assert seen == [[0]]
    store.create_run(run_id="run-3", name="c", settings={}, submitted_by="op")
    assert log.entries(0, 10) == store.log_entries(0, 10) and len(log.entries(0, 10)) == 2
    assert [i for i, _, _, _ in log.entries(1, 10)] == [1]
    store.close()
    with pytest.raises(StoppingError):
        log.entries(0, 10)


def test_a_plan_statement_is_what_a_site_rebuilds_from_the_plan(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.create_round(
        round_id="r1-x", run_id="run-1", number=1, parent_round_id="", stage=1,
        participants=["a"], deadline_ms=0,
    )  # fmt: skip
    store.update_round("r1-x", stage=2, deadline_ms=0, plan=b"plan-bytes", plan_signature=b"s")
    import hashlib

    mine = plan_statement(
        federation=FED, round_id="r1-x", plan_sha256=hashlib.sha256(b"plan-bytes").digest()
    )
    assert store.log_index(leaf_hash(mine)) == 0


def test_the_log_is_append_only_in_the_database(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"), store.transaction() as db:
        db.execute("UPDATE fedlog SET kind = 'x'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"), store.transaction() as db:
        db.execute("DELETE FROM fedlog")
    assert store.log_size() == 1


def test_a_restart_never_shrinks_the_log(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = _store(state)
    for i in range(3):
        store.create_run(run_id=f"run-{i}", name="a", settings={}, submitted_by="op")
    FederationLog(store, key=KEY, federation_id=FED).checkpoint()  # signed at size 3
    store.close()
    backup = tmp_path / "backup"
    shutil.copytree(state, backup)
    db = sqlite3.connect(state / DB_NAME)  # an operator edits the database by hand
    db.executescript("DROP TRIGGER fedlog_no_delete; DELETE FROM fedlog WHERE idx = 2;")
    db.close()
    with pytest.raises(StateError, match="never shrinks"):
        _store(state)
    # The same with the anchor gone too: the signed checkpoint in the database still holds it.
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    db = sqlite3.connect(state / DB_NAME)
    db.executescript("DROP TRIGGER fedlog_no_delete; DELETE FROM fedlog WHERE idx = 2;")
    db.close()
    (state / "anchor.json").unlink()
    with pytest.raises(StateError, match="fewer than its last signed checkpoint"):
        _store(state)
    # A rewritten statement under the checkpoint is refused as well.
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    db = sqlite3.connect(state / DB_NAME)
    db.executescript(
        "DROP TRIGGER fedlog_no_update; UPDATE fedlog SET entry = x'00' WHERE idx = 0;"
    )
    db.close()
    with pytest.raises(StateError, match="damaged at statement 0"):
        _store(state)
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    assert _store(state).log_size() == 3


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=6))
def test_checkpoints_grow_and_every_proof_verifies(tmp_path_factory: pytest.TempPathFactory,
                                                   batches: list[int]) -> None:  # fmt: skip
    store = _store(tmp_path_factory.mktemp("s"))
    log = FederationLog(store, key=KEY, federation_id=FED)
    seen: list[tuple[int, bytes]] = []
    n = 0
    for batch in batches:
        for _ in range(batch):
            store.create_run(run_id=f"run-{n}", name="a", settings={}, submitted_by="op")
            n += 1
        signed = log.checkpoint().signed
        checkpoint = verify_checkpoint(KEY.public_key(), signed)
        assert checkpoint.size == n
        for old_size, old_root in seen:
            if old_size > 0:
                verify_consistency(
                    old_size=old_size, new_size=n, old_root=old_root, new_root=checkpoint.root,
                    proof=log.consistency(old_size, n),
                )  # fmt: skip
        for index, _, entry, _ in store.log_entries(0, n):
            by_leaf, path = log.inclusion(leaf=leaf_hash(entry), index=0, size=n)
            assert by_leaf == index
            verify_inclusion(
                leaf=leaf_hash(entry), index=index, tree_size=n, proof=path, root=checkpoint.root
            )
        seen.append((n, checkpoint.root))
    with pytest.raises(InvalidRequestError):
        log.consistency(1, n + 1)


def test_a_cosignature_is_kept_only_from_the_enrolled_key_on_a_signed_checkpoint(
    tmp_path: Path,
) -> None:
    from afl.crypto.transparency.checkpoint import cosign
    from afl.server.errors import NotPermittedError
    from afl.server.store import EnrolmentRow

    store = _store(tmp_path)
    site_key = generate_identity_key()
    from afl.crypto.identity.signatures import public_key_to_raw

    row = EnrolmentRow("site-1", public_key_to_raw(site_key), "participant", ("a",), "bb", 4)
    store.put_enrolment(row, software_version="t")
    store.put_enrolment(row, software_version="t")  # re-enrolment, unchanged: no statement
    assert [k for _, k, _, _ in store.log_entries(0, 9)] == ["enrolment"]
    log = FederationLog(store, key=KEY, federation_id=FED)
    checkpoint = log.checkpoint().signed.checkpoint
    good = cosign(site_key, witness="site-1", checkpoint=checkpoint)
    forged = cosign(generate_identity_key(), witness="site-1", checkpoint=checkpoint)
    with pytest.raises(NotPermittedError):
        log.cosign("site-1", size=1, root=checkpoint.root, signature=forged.signature)
    kept = log.cosign("site-1", size=1, root=checkpoint.root, signature=good.signature)
    assert kept.signed.checkpoint == checkpoint and kept.cosignatures == (good,)
    assert [c.witness for c in log.cosigned(1).cosignatures] == ["site-1"]


def test_a_checkpoint_answer_carries_the_proofs_the_witnessing_site_asks_for(
    tmp_path: Path,
) -> None:
    """One GetCheckpoint answer per witnessing step (docs/protocol.md §11a): the consistency
    proof from the caller's last cosigned size and the inclusion proof of the statement it waits
    for, each verifying under RFC 9162 against the answered checkpoint's root; a statement the
    checkpoint does not hold gets no proof (the site polls on), and an older size above the
    asked one is refused naming both sizes."""
    store = _store(tmp_path)
    log = FederationLog(store, key=KEY, federation_id=FED)
    for n in range(3):
        store.create_run(run_id=f"run-{n}", name="a", settings={}, submitted_by="op")
    old = log.checkpoint().signed.checkpoint
    for n in range(3, 7):
        store.create_run(run_id=f"run-{n}", name="a", settings={}, submitted_by="op")
    entries = [entry for _, _, entry, _ in store.log_entries(0, 7)]
    asked = leaf_hash(entries[5])
    answer = log.answer(pb.CheckpointRequest(consistency_from=old.size, inclusion_leaf=asked))
    new = verify_checkpoint(KEY.public_key(), wire.checkpoint_from_proto(answer.checkpoint))
    assert (new.size, old.size) == (7, 3)
    verify_consistency(
        old_size=3, new_size=7, old_root=old.root, new_root=new.root, proof=list(answer.consistency)
    )
    assert answer.HasField("inclusion") and answer.inclusion.index == 5
    verify_inclusion(
        leaf=asked, index=5, tree_size=7, proof=list(answer.inclusion.hashes), root=new.root
    )
    # The checkpoint of an older size: the statement appended after it is not in it.
    at_old = log.answer(pb.CheckpointRequest(size=old.size, inclusion_leaf=asked))
    assert at_old.checkpoint.size == 3 and not at_old.HasField("inclusion")
    assert not log.answer(pb.CheckpointRequest(inclusion_leaf=leaf_hash(b"never"))).HasField(
        "inclusion"
    )
    # Nothing to prove from 0 (a first checkpoint) or from the same size.
    for since in (0, 7):
        assert list(log.answer(pb.CheckpointRequest(consistency_from=since)).consistency) == []
    with pytest.raises(InvalidRequestError, match="from size 7 to the checkpoint of size 3"):
        log.answer(pb.CheckpointRequest(size=3, consistency_from=7))
    # The newest checkpoint smaller than what the caller cosigned comes without a proof: the
    # site keeps it as evidence of a log that shrank.
    rolled_back = log.answer(pb.CheckpointRequest(consistency_from=9))
    assert rolled_back.checkpoint.size == 7 and list(rolled_back.consistency) == []


def test_the_coordinator_appends_only_the_decrypting_statement_its_decryptor_signed(
    tmp_path: Path,
) -> None:
    """M-235: a `decrypting` statement is appended once, when it names the caller, verifies
    under the caller's enrolled key and names the plan of the round being decrypted, which the
    log holds; anything else is refused and appends nothing."""
    store = _store(tmp_path)
    log = FederationLog(store, key=KEY, federation_id=FED)
    decryptor = generate_identity_key()
    store.put_enrolment(
        EnrolmentRow("dec", public_key_to_raw(decryptor), "decryptor", (), "bb", 0),
        software_version="test",
    )
    plan = b"the signed plan of r1-c"
    digest = hashlib.sha256(plan).digest()
    store.create_round(
        round_id="r1-c", run_id="run-1", number=1, parent_round_id="", stage=1,
        participants=[], deadline_ms=0,
    )  # fmt: skip
    store.update_round("r1-c", stage=2, deadline_ms=0, plan=plan, plan_signature=b"s")
    assert store.log_index(
        leaf_hash(plan_statement(federation=FED, round_id="r1-c", plan_sha256=digest))
    )

    def statement(key: object = decryptor, *, site: str = "dec", round_id: str = "r1-c") -> bytes:
        signature = sign_fields(
            key,  # type: ignore[arg-type]
            context=DECRYPTING_CONTEXT,
            fields=decrypting_signed_fields(
                federation=FED, decryptor=site, round_id=round_id, plan_sha256=digest
            ),
        )
        return decrypting_statement(
            federation=FED, decryptor=site, round_id=round_id, plan_sha256=digest,
            signature=signature,
        )  # fmt: skip

    def solving(round_id: str) -> bytes:
        return digest if round_id == "r1-c" else b""

    size = store.log_size()
    with pytest.raises(NotPermittedError, match="names site 'site-1', the caller is 'dec'"):
        log.record_decrypting("dec", statement(site="site-1"), solving=solving)
    with pytest.raises(NotPermittedError, match="decrypting signature does not verify"):
        log.record_decrypting("dec", statement(generate_identity_key()), solving=solving)
    with pytest.raises(WrongStageError, match="not the one the decrypting statement names"):
        log.record_decrypting("dec", statement(round_id="r2-other"), solving=solving)
    with pytest.raises(WrongStageError, match="not the one the decrypting statement names"):
        log.record_decrypting("dec", statement(), solving=lambda round_id: b"\x01" * 32)
    assert store.log_size() == size  # nothing appended
    index = log.record_decrypting("dec", statement(), solving=solving)
    assert index == size and log.record_decrypting("dec", statement(), solving=solving) == index
    kind, fields = decode_statement(store.log_entries(index, index + 1)[0][2], federation=FED)
    assert kind == "decrypting" and fields["site"] == "dec" and fields["round_id"] == "r1-c"
