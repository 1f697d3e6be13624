"""Server side of the MASK mode (docs/protocol.md §4.2, §5): the plan's fixed-point encodings
respect K·B·2^f < 2^63 with the most fractional bits, masked uploads are refused outside the
UPLOAD stage, and a masked input the protocol refuses is the uploader's error, never stored."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.modes.mask import MaskMode as ClientMask
from afl.client.payloads.stats import PayloadError
from afl.crypto.errors import CryptoError, RoundAbortedError
from afl.crypto.identity.custody import RosterSite
from afl.crypto.identity.signatures import public_key_to_raw
from afl.crypto.secagg.graph_bounds import choose_graph
from afl.crypto.secagg.server import SecAggResult
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import MaskSettings, round_template, run_settings, settings_table
from afl.server.errors import ConfigError, InvalidRequestError, NotPermittedError, WrongStageError
from afl.server.modes.mask import MaskMode
from afl.server.plan.release import RoundView, build_plan, releases_from_plan, round1_releases
from afl.server.store import MessageRow, RoundRow, UploadRow

SITES = ("site-1", "site-2", "site-3", "site-4")


def _mode(gram: float = 5.0e4, vector: float = 20.0) -> MaskMode:
    keys = {s: public_key_to_raw(Ed25519PrivateKey.generate().public_key()) for s in SITES}
    return MaskMode(MaskSettings(gram_bound=gram, vector_bound=vector), identities=keys)


def _plan(mode: MaskMode, d: int = 6) -> cpb.ReleasePlan:
    releases = round1_releases(
        classes=("A", "B"),
        participants=SITES,
        coverage={},
        gram_scope="global",
        d=d,
        need_global_gram=False,
    )
    return build_plan(
        federation_id="fed",
        round_id="r1-x",
        round_number=1,
        participants=SITES,
        gram_scope="global",
        releases=releases,
        options=mode.plan_options(SITES),
    )


@settings(max_examples=30, deadline=None)
@given(gram=st.floats(1.0, 1.0e9), vector=st.floats(1.0e-3, 1.0e3))
def test_encodings_use_the_most_fractional_bits_below_the_ring_half(
    gram: float, vector: float
) -> None:
    plan = _plan(_mode(gram, vector))
    assert plan.aggregation == cpb.AGGREGATION_MODE_MASK
    assert plan.mask_threshold == 3  # a majority of 4
    for release in plan.releases:
        fp = release.encoding.fixed_point
        assert release.encoding.dtype == cpb.DTYPE_UINT64_LE
        k = len(release.member_site_ids)
        assert k * fp.bound * 2.0**fp.frac_bits < 2.0**63
        assert k * fp.bound * 2.0 ** (fp.frac_bits + 1) >= 2.0**63 * (1 - 1e-12)
        expected = gram if release.kind == cpb.STATISTIC_KIND_GRAM else vector
        assert fp.bound == expected


class _Context:
    """The round context of a mode, with uploads kept in memory."""

    def __init__(self) -> None:
        self.decoded: dict[str, dict[str, tuple[str, ...]]] = {}
        self.payloads: dict[tuple[str, str], bytes] = {}
        self.journal: list[MessageRow] = []
        self.audits: list[tuple[str, dict[str, Any]]] = []

    def now_ms(self) -> int:
        return 0

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        return dict.fromkeys(SITES, (True, ""))

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        return {k: UploadRow(k[0], k[1], b"", len(v), Path("/")) for k, v in self.payloads.items()}

    def site_uploads(self, round_id: str, site_id: str) -> dict[str, UploadRow]:
        return {r: row for (s, r), row in self.uploads(round_id).items() if s == site_id}

    def read_payload(self, row: UploadRow) -> bytes:
        return self.payloads[(row.site_id, row.release_name)]

    def put_message(
        self, round_id: str, *, stage: int, site_id: str, kind: str, data: bytes
    ) -> None:
        self.journal.append(MessageRow(stage, site_id, kind, data))

    def messages(self, round_id: str) -> list[MessageRow]:
        return list(self.journal)

    def audit(self, event: str, detail: Mapping[str, object]) -> None:
        self.audits.append((event, dict(detail)))

    def exposes_history(self, view: Any, releases: Any, members: Any) -> str:
        return ""  # no earlier runs in these unit tests

    def note_decoded(self, round_id: str, contributors: Mapping[str, Any]) -> None:
        self.decoded[round_id] = {name: tuple(sites) for name, sites in contributors.items()}

    def row_bounds(self, site_id: str) -> Any:
        return None  # mask does not read the declarations through the context


def _view(plan: cpb.ReleasePlan, stage: int) -> RoundView:
    data = plan.SerializeToString()
    row = RoundRow("r1-x", 1, "", stage, SITES, data, b"", 0, "")
    return RoundView(row, tuple(releases_from_plan(data)))


def test_masked_upload_only_in_the_upload_stage() -> None:
    mode, ctx = _mode(), _Context()
    plan = _plan(mode)
    view = _view(plan, pb.ROUND_STAGE_ADVERTISE_KEYS)
    assert mode.begin(view, ctx).stage == pb.ROUND_STAGE_ADVERTISE_KEYS
    gram = view.releases[0]
    data = bytes(8 * gram.length)
    with pytest.raises(WrongStageError, match="UPLOAD stage"):
        mode.check_upload(view, ctx, site_id="site-1", release=gram, data=data)
    upload = _view(plan, pb.ROUND_STAGE_UPLOAD)
    with pytest.raises(InvalidRequestError, match="must be"):
        mode.check_upload(upload, ctx, site_id="site-1", release=gram, data=data[:-8])
    mode.check_upload(upload, ctx, site_id="site-1", release=gram, data=data)  # accepted now


def test_a_refused_masked_input_is_the_uploaders_error() -> None:
    """The site's last release hands its masked input to the protocol before it is stored: a
    site outside U2 (here: the protocol has not closed ShareKeys, so nobody is in U2) gets the
    refusal as its own error status instead of a receipt."""
    mode, ctx = _mode(), _Context()
    plan = _plan(mode)
    view = _view(plan, pb.ROUND_STAGE_UPLOAD)
    mode.begin(view, ctx)
    releases = [r for r in view.releases if "site-1" in r.members]
    for release in releases[:-1]:
        mode.check_upload(
            view, ctx, site_id="site-1", release=release, data=bytes(8 * release.length)
        )
        ctx.payloads[("site-1", release.name)] = bytes(8 * release.length)
    last = releases[-1]
    with pytest.raises(InvalidRequestError, match="masked input refused"):
        mode.check_upload(view, ctx, site_id="site-1", release=last, data=bytes(8 * last.length))
    mode.rounds["r1-x"].expected.discard("site-2")
    with pytest.raises(NotPermittedError, match="dropped out"):
        mode.check_upload(view, ctx, site_id="site-2", release=last, data=bytes(8 * last.length))


class _StoredContext(_Context):
    """Upload rows that carry the stored payload's SHA-256; payloads read from disk noted."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[str] = []

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        return {
            k: UploadRow(k[0], k[1], hashlib.sha256(v).digest(), len(v), Path("/"))
            for k, v in self.payloads.items()
        }

    def read_payload(self, row: UploadRow) -> bytes:
        self.read.append(row.release_name)
        return super().read_payload(row)


def test_a_sites_earlier_releases_are_fed_from_memory_only_where_the_store_holds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The payloads a site uploads before its last release are held under their verified
    digest, and handed to the protocol with the last one without being read back from disk;
    where the stored row names another digest (the bytes held are not what was stored), or
    after a restart (nothing held), the stored payload is read. Nothing stays held."""
    mode, ctx = _mode(), _StoredContext()
    plan = _plan(mode)
    view = _view(plan, pb.ROUND_STAGE_UPLOAD)
    mode.begin(view, ctx)
    fed: dict[str, bytes] = {}
    monkeypatch.setattr(mode, "_feed", lambda view, state, site, payloads: fed.update(payloads))
    releases = [r for r in view.releases if "site-1" in r.members]
    assert len(releases) >= 3
    stored: dict[str, bytes] = {}
    for i, release in enumerate(releases[:-1]):
        data = bytes([i + 1]) * (8 * release.length)
        mode.prepare_upload(
            site_id="site-1", release=release, data=data, sha256=hashlib.sha256(data).digest()
        )
        mode.check_upload(view, ctx, site_id="site-1", release=release, data=data)
        # The first release's stored bytes differ from those held (another upload was stored).
        stored[release.name] = bytes(8 * release.length) if i == 0 else data
        ctx.payloads[("site-1", release.name)] = stored[release.name]
    last = releases[-1]
    data = b"\x07" * (8 * last.length)
    mode.prepare_upload(
        site_id="site-1", release=last, data=data, sha256=hashlib.sha256(data).digest()
    )
    mode.check_upload(view, ctx, site_id="site-1", release=last, data=data)
    assert fed == {**stored, last.name: data}
    assert ctx.read == [releases[0].name]  # only the one whose digest differed
    assert mode._held == {}


def test_wire_config_is_the_signed_plans() -> None:
    plan = _plan(_mode())
    digest = hashlib.sha256(plan.SerializeToString()).digest()
    config = wire.round_config_from_plan(plan, plan_sha256=digest)
    assert config.t == 3 and config.cohort == SITES and config.context == digest
    assert {r.name: r.length for r in config.releases} == {
        r.name: wire.release_length(r) for r in plan.releases
    }
    with pytest.raises(CryptoError, match="plan digest has 31 bytes"):
        wire.round_config_from_plan(plan, plan_sha256=digest[:31])


def test_the_coordinators_config_binds_the_stored_plans_digest() -> None:
    """The coordinator verifies adverts and consistency signatures under the SHA-256 of the plan
    bytes it signed and stored, the context the sites bind (docs/protocol.md M-223)."""
    mode, ctx = _mode(), _Context()
    view = _view(_plan(mode), pb.ROUND_STAGE_ADVERTISE_KEYS)
    mode.begin(view, ctx)
    assert view.row.plan is not None
    oracle = hashlib.sha256(view.row.plan).digest()
    assert mode.rounds["r1-x"].server.config.context == oracle


def test_site_refuses_values_beyond_the_declared_bound() -> None:
    plan = _plan(_mode(vector=1.0))
    b_release = next(r for r in plan.releases if r.kind == cpb.STATISTIC_KIND_CLASS_VECTOR)
    # The refusal names the server.toml value that fits, as a power of two (never the value).
    with pytest.raises(PayloadError, match=r"exceeds the plan's bound 1 .*mask_vector_bound = 4 "):
        ClientMask().encode(b_release, np.full(6, 2.5))
    assert len(ClientMask().encode(b_release, np.full(6, 0.5))) == 48


def test_a_sparse_plan_carries_the_chosen_graph_and_t_equals_n_minus_d() -> None:
    """mask_graph = "sparse": k and t_N from choose_graph for the participants at the configured
    fractions, t = n - D in the plan and the wire config; too few sites for any sparse graph
    (or the default full graph) leave the plan without one."""
    many = tuple(f"s{i:02d}" for i in range(40))
    keys = {s: public_key_to_raw(Ed25519PrivateKey.generate().public_key()) for s in many}
    sparse = MaskMode(
        MaskSettings(gram_bound=10.0, vector_bound=1.0, graph="sparse", dropout_fraction=0.1),
        identities=keys,
    )
    options = sparse.plan_options(many)
    graph = options.mask_graph
    assert graph is not None
    choice = choose_graph(n=40, colluders=14, dropouts=4)  # ⌈0.333·40⌉, ⌊0.1·40⌋
    assert choice is not None
    assert (graph.degree, graph.share_threshold) == (choice.degree, choice.share_threshold)
    assert (graph.colluders, graph.dropouts, graph.failure_log2) == (14, 4, choice.failure_log2)
    assert options.mask_threshold == 36
    plan = build_plan(
        federation_id="fed", round_id="r1-s", round_number=1, participants=many,
        gram_scope="global", releases=round1_releases(
            classes=("A",), participants=many, coverage={}, gram_scope="global", d=3,
            need_global_gram=False,
        ), options=options,
    )  # fmt: skip
    config = wire.round_config_from_plan(plan, plan_sha256=b"")
    assert config.t == 36 and config.graph is not None and config.graph.degree == graph.degree
    assert sparse.plan_options(SITES[:4]).mask_graph is None  # 4 sites: the full graph
    assert _mode().plan_options(many).mask_graph is None  # mask_graph = "full" (the default)


def test_sparse_graph_settings_are_checked() -> None:
    sites = {s: RosterSite(bytes(32), "participant") for s in SITES}
    base = round_template(
        {"classes": ["A"], "feature_dim": 4, "aggregation": "mask", "mask_gram_bound": 1.0}
    )
    base["mask_vector_bound"] = 1.0
    for change, message in (
        ({"mask_graph": "ring"}, "must be one of"),
        ({"mask_graph": "sparse", "gram_scope": "per-class"}, "gram_scope = 'global'"),
        ({"mask_graph": "sparse", "mask_threshold": 3}, "sets t = n - D itself"),
        ({"mask_colluder_fraction": 0.5, "mask_dropout_fraction": 0.25}, "colluders \\+ 2"),
        ({"mask_security_bits": 0}, "must lie in 1..128"),
    ):
        with pytest.raises(ConfigError, match=message):
            run_settings({**base, **change}, source="run", sites=sites)
    settings = run_settings({**base, "mask_graph": "sparse"}, source="run", sites=sites)
    assert settings.mask is not None and settings.mask.graph == "sparse"
    assert run_settings(settings_table(settings), source="again", sites=sites) == settings


def test_a_withheld_release_states_the_sums_the_coordinator_decoded() -> None:
    """A release withheld at unmasking aborts the round; the reason and the "mask-withheld"
    audit record say which other releases' sums the coordinator nevertheless decoded (names and
    the SHA-256 of their values), never "nothing released" (docs/protocol.md M-163)."""
    mode, ctx = _mode(), _Context()
    view = _view(_plan(mode), pb.ROUND_STAGE_UNMASK)
    mode.begin(view, ctx)
    decoded_name, withheld_name = view.releases[0].name, view.releases[1].name
    values = np.arange(view.releases[0].length, dtype=np.float64)
    result = SecAggResult(
        sums={decoded_name: values},
        contributors={decoded_name: SITES[:3]},
        withheld={withheld_name: "fewer than the release minimum 3"},
        survivors=SITES[:3],
        dropped=SITES[3:],
    )
    state = mode.rounds["r1-x"]
    state.server = cast(Any, SimpleNamespace(result=result))
    with pytest.raises(RoundAbortedError) as raised:
        mode._keep_result(view, ctx, state)
    reason = str(raised.value)
    assert "nothing released" not in reason
    assert f"decoded the sums of {decoded_name}" in reason and withheld_name in reason
    [(event, detail)] = ctx.audits
    assert event == "mask-withheld" and detail["round_id"] == "r1-x"
    oracle = hashlib.sha256(values.astype("<f8").tobytes()).hexdigest()
    assert detail["decoded"] == [{"release": decoded_name, "sha256": oracle}]
    assert detail["withheld"] == {withheld_name: "fewer than the release minimum 3"}
    assert "r1-x" not in mode._sums  # nothing kept for a solve
    # ... and the round machine is told, so the federation log's release statement of the
    # aborted round names the decoded release over the sites in its sum (M-209).
    assert ctx.decoded == {"r1-x": {decoded_name: tuple(SITES[:3])}}


class _Access:
    """What MaskRequests uses of the coordinator: one round over SITES in UNMASK, whose mode
    hands out ``state`` and counts how often the unmask request is built."""

    def __init__(self, mode: MaskMode, view: RoundView) -> None:
        import threading

        self.lock = threading.Condition()
        self.mode, self.view, self.context = mode, view, _Context()

    def require_enrolled(self, site_id: str) -> None:
        pass

    def find(self, round_id: str) -> RoundView:
        return self.view

    def mode_of(self, view: RoundView) -> MaskMode:
        return self.mode

    def require_participant(self, view: RoundView, site_id: str) -> None:
        if site_id not in view.row.participants:
            raise NotPermittedError(f"{site_id} is not a participant")

    def advance(self) -> None:
        pass


def test_an_answer_every_participant_gets_alike_is_built_once_and_each_caller_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The graph commitments, key directory, survivors, consistency signatures and unmask
    request: each built on the first request (a change to the round's state afterwards does
    not show in later answers, so none is rebuilt), each caller's copy its own, and the caller
    checked every time."""
    from afl.crypto.secagg.messages import (
        AdvertiseKeys,
        ConsistencySignature,
        KeyDirectory,
        UnmaskRequest,
    )
    from afl.server.modes.mask import MaskRequests, MaskRound

    mode = _mode()
    view = _view(_plan(mode), pb.ROUND_STAGE_UNMASK)
    signed = tuple(ConsistencySignature("r1-x", s, bytes([i]) * 64) for i, s in enumerate(SITES))
    state = MaskRound(
        server=cast(Any, SimpleNamespace(config=SimpleNamespace(graph=object()))),
        lengths={},
        expected=set(SITES),
        directory=KeyDirectory(
            "r1-x", tuple(AdvertiseKeys("r1-x", s, b"c" * 32, b"m" * 32, b"s" * 64) for s in SITES)
        ),
        survivors=SITES,
        unmask=UnmaskRequest("r1-x", SITES, (), ("gram",), signed),
        decisions={
            s: pb.PlanDecision(plan_sha256=b"p" * 32, graph_commitment=b"g" * 32, signature=b"x")
            for s in SITES
        },
    )
    monkeypatch.setattr(MaskMode, "state", lambda self, view, ctx, stage: state)
    requests = MaskRequests(cast(Any, _Access(mode, view)))
    getters: dict[str, Any] = {
        "commitments": requests.graph_commitments,
        "directory": requests.advertised_keys,
        "survivors": requests.survivors,
        "signatures": requests.consistency_signatures,
        "unmask": requests.unmask_request,
    }
    first: dict[str, Any] = {name: get("site-1", "r1-x") for name, get in getters.items()}
    assert sorted(state.answers) == sorted(getters)
    assert state.directory is not None and state.unmask is not None
    assert [c.site_id for c in first["commitments"].commitments] == list(SITES)
    assert first["directory"] == wire.directory_to_proto(state.directory)
    assert list(first["survivors"].survivors) == list(SITES)
    assert [s.site_id for s in first["signatures"].signatures] == list(SITES)
    assert first["unmask"] == wire.unmask_request_to_proto(state.unmask)
    # The round's state changes (it never does once built: this shows nothing is rebuilt), and
    # one caller alters its copy: the next caller gets what the first one got.
    state.decisions.clear()
    state.directory = KeyDirectory("r1-x", ())
    state.survivors = ()
    state.unmask = UnmaskRequest("r1-x", (), (), (), ())
    first["unmask"].survivors.append("forged")
    for name, get in getters.items():
        again = get("site-2", "r1-x")
        assert again is not first[name]
        if name != "unmask":
            assert again == first[name], name
    assert list(getters["unmask"]("site-3", "r1-x").survivors) == list(SITES)
    for get in getters.values():
        with pytest.raises(NotPermittedError, match="not a participant"):  # checked every time
            get("site-9", "r1-x")
