"""Server side of the CKKS mode (docs/protocol.md §4.3): the server never holds a secret key (a
private context, configured or found in its state, makes it refuse to start; a published one is
refused), the decryptor is never a data participant, and CKKS plans declare a pre-scale and grid
that respect the slot budget and hide the CKKS noise."""

from __future__ import annotations

import hashlib
import stat
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.wire import DECRYPTION_CONTEXT, decryption_fields
from afl.crypto.errors import CkksContextError
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw, sign_fields
from afl.lab.demo.federation import free_port
from afl.ops.provisioning import provision
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.daemon import main as daemon
from afl.server.errors import (
    ConfigError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.modes.base import ModeEnvironment, RoundAccess
from afl.server.modes.ckks import CkksMode, CkksRequests
from afl.server.modes.ckks_context import CkksContexts, PublishedContext
from afl.server.modes.registry import mode_for
from afl.server.plan.release import PlannedRelease

SITES = ("dec", "site-1", "site-2", "site-3")


def _federation(tmp_path: Path, context: bytes | None) -> Path:
    fed = provision(
        tmp_path / "fed",
        sites=SITES,
        decryptor="dec",
        port=free_port(),  # a fixed port may be another process's on a shared machine
        round_settings={"classes": ["A"], "feature_dim": 4, "aggregation": "ckks"},
    )
    config = fed.server_dir / "server.toml"
    if context is not None:
        (fed.server_dir / "ctx.bin").write_bytes(context)
        config.write_text(config.read_text() + '\n[ckks]\npublic_context = "ctx.bin"\n')
    return config


def test_server_with_a_private_context_refuses_to_start(
    tmp_path: Path, private_ctx: object, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _federation(tmp_path, ckks.private_context_bytes(private_ctx))
    assert daemon.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "refusing to start" in err and "secret key" in err


def test_server_with_the_public_context_builds_the_ckks_mode(
    tmp_path: Path, private_ctx: object
) -> None:
    config = load_config(_federation(tmp_path, ckks.public_context_bytes(private_ctx)))
    assert config.round.participants == ("site-1", "site-2", "site-3")  # not the decryptor
    mode = mode_for(ModeEnvironment(config, config.round, CkksContexts.from_config(config)))
    assert isinstance(mode, CkksMode) and mode.contexts.configured is not None


def test_dp_with_ckks_needs_the_largest_site(tmp_path: Path) -> None:
    config = _federation(tmp_path, None)
    text = config.read_text() + "\n[round.dp]\nepsilon = 2.0\nclip_norm = 1.0\n"
    config.write_text(text)
    with pytest.raises(ConfigError, match="needs max_samples"):
        load_config(config)
    config.write_text(text + "max_samples = 500\n")
    loaded = load_config(config)
    mode = mode_for(ModeEnvironment(loaded, loaded.round, CkksContexts.from_config(loaded)))
    assert isinstance(mode, CkksMode) and mode.settings is not None
    assert mode.settings.dp is not None and mode.settings.dp.max_samples == 500


def test_decryptor_cannot_be_listed_as_a_participant(tmp_path: Path) -> None:
    config = _federation(tmp_path, None)
    text = config.read_text().replace("participants = []", 'participants = ["dec", "site-1"]')
    config.write_text(text)
    with pytest.raises(ConfigError, match="decryptor site holds no data"):
        load_config(config)


def test_private_context_in_the_state_dir_refuses_restart(
    tmp_path: Path, private_ctx: object
) -> None:
    folder = tmp_path / "ckks"
    folder.mkdir()
    (folder / "context.bin").write_bytes(ckks.private_context_bytes(private_ctx))
    (folder / "announcement.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="refusing to start"):
        CkksContexts(state_dir=tmp_path)


def test_publish_refuses_a_private_context_and_keeps_the_first(
    tmp_path: Path, private_ctx: object
) -> None:
    contexts = CkksContexts(state_dir=tmp_path)
    announcement = pb.CkksContextAnnouncement(decryptor_site_id="dec")
    secret = ckks.private_context_bytes(private_ctx)
    with pytest.raises(CkksContextError):
        contexts.publish(PublishedContext(secret, private_ctx, announcement))
    assert contexts.published is None and not (tmp_path / "ckks" / "context.bin").exists()
    data = ckks.public_context_bytes(private_ctx)
    contexts.publish(PublishedContext(data, ckks.load_public_context(data), announcement))
    assert CkksContexts(state_dir=tmp_path).published is not None  # survives a restart
    folder = tmp_path / "ckks"  # kept private like the rest of the state
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {
        "context.bin": 0o600,
        "announcement.bin": 0o600,
    }


@settings(max_examples=40, deadline=None)
@given(
    bound=st.floats(min_value=1e-3, max_value=1e9),
    members=st.integers(min_value=1, max_value=64),
)
def test_plan_encoding_respects_slot_budget_and_hides_noise(bound: float, members: int) -> None:
    enc = CkksMode(gram_bound=bound).encoding(members)
    assert members * bound * enc.prescale <= cp.SUM_SLOT_BOUND  # the sum never wraps
    assert 2 * members * bound * enc.prescale > cp.SUM_SLOT_BOUND  # and uses the budget
    assert enc.grid_step >= cp.min_grid(prescale=enc.prescale, num_summands=members)


def test_plan_options_make_every_release_ckks_vectors() -> None:
    strategy = CkksMode(gram_bound=10.0, vector_bound=0.5)
    options = strategy.plan_options(("a", "b"))
    assert options.aggregation == cpb.AGGREGATION_MODE_CKKS
    gram = PlannedRelease("gram[all]", ("a", "b"), cpb.STATISTIC_KIND_GRAM, (), (3, 3))
    assert options.encoding is not None
    encoding = options.encoding(gram)
    assert encoding.dtype == cpb.DTYPE_CKKS_VECTORS
    assert encoding.packing == cpb.PACKING_UPPER_TRIANGLE
    assert encoding.ckks.prescale == cp.choose_prescale(bound=10.0, num_summands=2)
    b = PlannedRelease("b[A]", ("a", "b"), cpb.STATISTIC_KIND_CLASS_VECTOR, ("A",), (3, 1))
    b_encoding = options.encoding(b)
    assert b_encoding.packing == cpb.PACKING_DENSE
    assert b_encoding.ckks.prescale == cp.choose_prescale(bound=0.5, num_summands=2)


def test_ckks_needs_exactly_one_decryptor_site(tmp_path: Path) -> None:
    fed = provision(
        tmp_path / "fed",
        sites=SITES,
        round_settings={"classes": ["A"], "feature_dim": 4, "aggregation": "ckks"},
    )
    with pytest.raises(ConfigError, match="exactly one site with role"):
        load_config(fed.server_dir / "server.toml")


def test_a_decryption_outcome_counts_only_for_the_federation_round_and_plan_it_was_signed_for() -> (
    None
):
    """The decryptor's signed outcome binds the federation, the round and the digest of the
    round's signed plan: an outcome signed for another federation, round or plan (a coordinator
    replaying a refusal or a result digest from elsewhere) does not verify."""
    key = generate_identity_key()
    plan = b"the round's signed release plan"
    decryptor = SimpleNamespace(role="decryptor", identity_public_key=public_key_to_raw(key))
    view = SimpleNamespace(round_id="r1-a", row=SimpleNamespace(plan=plan), releases=())
    access = SimpleNamespace(
        config=SimpleNamespace(federation_id="fed-a", sites={"dec": decryptor}),
        require_enrolled=lambda site: None,
        lock=threading.RLock(),
        find=lambda round_id: view,
    )
    requests = CkksRequests(cast(RoundAccess, access), cast(CkksContexts, None))
    bound: dict[str, Any] = {
        "federation_id": "fed-a",
        "round_id": "r1-a",
        "plan_sha256": hashlib.sha256(plan).digest(),
        "release_name": "gram",
        "status": pb.DECRYPTION_STATUS_DECRYPTED,
        "result_sha256": b"\x05" * 32,
    }

    def outcome(**other: Any) -> pb.DecryptionOutcome:
        fields = bound | other
        return pb.DecryptionOutcome(
            round_id="r1-a",
            release_name="gram",
            status=pb.DECRYPTION_STATUS_DECRYPTED,
            result_sha256=b"\x05" * 32,
            signature=sign_fields(
                key, context=DECRYPTION_CONTEXT, fields=decryption_fields(**fields)
            ),
        )

    for other in (
        {"federation_id": "fed-b"},
        {"round_id": "r1-b"},
        {"plan_sha256": hashlib.sha256(b"another plan of the round").digest()},
    ):
        with pytest.raises(NotPermittedError, match="signature does not verify"):
            requests.report("dec", outcome(**other))
    # Bound right, the signature verifies; this stand-in round plans no release of that name.
    with pytest.raises(InvalidRequestError, match="no release named 'gram'"):
        requests.report("dec", outcome())


def _two_rounds(ckks_round: Any, **access: Any) -> CkksRequests:
    """CkksRequests over a stand-in coordinator with two rounds at ``ckks_round``'s stage: r1-c
    (``ckks_round``, in ``ckks``) and r1-m (another mode); ``access``: its other members."""
    masked_round = SimpleNamespace(round_id="r1-m", stage=ckks_round.stage)
    rounds = {"r1-c": ckks_round, "r1-m": masked_round}

    def find(round_id: str) -> Any:
        if round_id not in rounds:
            raise WrongStageError(f"no round {round_id!r} on this server")
        return rounds[round_id]

    ckks_mode = CkksMode.__new__(CkksMode)  # contributors() reads the round's participants
    stand_in = SimpleNamespace(
        require_enrolled=lambda site: None,
        lock=threading.RLock(),
        find=find,
        mode_of=lambda view: ckks_mode if view is ckks_round else object(),
        **access,
    )
    return CkksRequests(cast(RoundAccess, stand_in), cast(CkksContexts, None))


def test_a_ckks_round_takes_a_participant_s_opening_over_every_participant_in_its_upload_stage() -> (
    None
):
    """M-232 in ``ckks``: an opening of a CKKS round must state every participant as its
    survivors (a CKKS sum holds every participant's ciphertext, or the round aborts), from a
    participant, while the round is in its upload stage (before the site's first statistic);
    a round of another mode, or none, is not a CKKS round."""
    participants = ["site-1", "site-2", "site-3"]
    ckks_round = SimpleNamespace(
        round_id="r1-c", stage=pb.ROUND_STAGE_UPLOAD, row=SimpleNamespace(participants=participants)
    )

    def require_participant(view: Any, site_id: str) -> None:
        if site_id not in view.row.participants:
            raise NotPermittedError(f"site {site_id!r} is not a participant")

    requests = _two_rounds(
        ckks_round, require_participant=require_participant, advance=lambda: None
    )
    assert requests.runs_ckks("r1-c")
    assert not requests.runs_ckks("r1-m") and not requests.runs_ckks("r9-none")
    assert requests.opening_survivors("site-2", "r1-c") == participants
    with pytest.raises(NotPermittedError, match="not a participant"):
        requests.opening_survivors("site-9", "r1-c")
    for stage in (pb.ROUND_STAGE_PLAN_REVIEW, pb.ROUND_STAGE_SOLVING, pb.ROUND_STAGE_PUBLISHED):
        ckks_round.stage = stage
        with pytest.raises(WrongStageError, match="takes openings in its upload stage"):
            requests.opening_survivors("site-2", "r1-c")


def test_only_the_decryptor_states_its_decryption_and_only_while_the_round_is_solving() -> None:
    """M-235: the plan digest a `decrypting` statement must name is answered only to the
    federation's decryptor, for a CKKS round in its solving stage."""
    plan = b"the signed plan bytes"
    ckks_round = SimpleNamespace(
        round_id="r1-c", stage=pb.ROUND_STAGE_SOLVING, row=SimpleNamespace(plan=plan)
    )
    sites = {
        "site-1": SimpleNamespace(role="participant"),
        "dec": SimpleNamespace(role="decryptor"),
    }
    requests = _two_rounds(ckks_round, config=SimpleNamespace(sites=sites))
    assert requests.decrypting_plan("dec", "r1-c") == hashlib.sha256(plan).digest()
    with pytest.raises(NotPermittedError, match="not the federation's CKKS decryptor"):
        requests.decrypting_plan("site-1", "r1-c")
    with pytest.raises(WrongStageError, match="does not run aggregation = 'ckks'"):
        requests.decrypting_plan("dec", "r1-m")
    for stage in (pb.ROUND_STAGE_UPLOAD, pb.ROUND_STAGE_PUBLISHED, pb.ROUND_STAGE_ABORTED):
        ckks_round.stage = stage
        with pytest.raises(WrongStageError, match="states its decryption in the solving stage"):
            requests.decrypting_plan("dec", "r1-c")
