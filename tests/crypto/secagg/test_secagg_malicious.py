"""A malicious server against honest secure-aggregation clients (docs/protocol.md §4.2): the client
refuses any Unmask request that would reveal both the self-mask share and the mask-key share of one
peer, or that is inconsistent with the survivor list it signed; it rejects forged adverts and
tampered share bundles."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from afl.crypto.errors import ProtocolError, RoundAbortedError, StageError, UnmaskRefusedError
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.config import ReleaseSpec
from afl.crypto.secagg.messages import (
    ConsistencyRequest,
    EncryptedShare,
    KeyDirectory,
    RoutedShares,
    Stage,
    UnmaskRequest,
)
from afl.crypto.secagg.server import SecAggServer
from afl.crypto.shamir import PRIME, Share
from tests.crypto.secagg_helpers import (
    Federation,
    honest_clients,
    honest_round,
    make_federation,
    run_to_survivors,
)


@dataclass
class AtUnmask:
    """A round run honestly up to the server's UnmaskRequest."""

    fed: Federation
    server: SecAggServer
    clients: dict[str, SecAggClient]
    request: UnmaskRequest


def _run_to_consistency(
    fed: Federation,
    *,
    silent: tuple[str, ...] = (),
    floors: dict[str, dict[str, int]] | None = None,
) -> tuple[SecAggServer, dict[str, SecAggClient], ConsistencyRequest]:
    """Run honestly to the survivor list U3; ``silent`` sites vanish after ShareKeys (U2 \\ U3);
    ``floors`` gives sites their policy's survivor floors."""
    server, clients = honest_round(fed)
    identities = {s: k.public_key() for s, k in fed.keys.items()}
    for site, floor in (floors or {}).items():
        clients[site] = SecAggClient(
            site_id=site, identity_key=fed.keys[site], config=fed.config,
            identities=identities, inputs=fed.inputs[site], survivor_floors=floor,
        )  # fmt: skip
    return server, clients, run_to_survivors(server, clients, silent=silent)


def _run_to_unmask_fed(
    fed: Federation,
    *,
    silent: tuple[str, ...] = (),
    floors: dict[str, dict[str, int]] | None = None,
) -> AtUnmask:
    server, clients, u3 = _run_to_consistency(fed, silent=silent, floors=floors)
    for s in u3.survivors:
        server.receive(clients[s].consistency_check(u3), sender=s)
    return AtUnmask(fed, server, clients, server.close_consistency())


def _run_to_unmask(n: int = 5, *, silent: tuple[str, ...] = ()) -> AtUnmask:
    return _run_to_unmask_fed(make_federation(n=n), silent=silent)


def test_request_for_both_shares_of_one_peer_is_refused() -> None:
    run = _run_to_unmask(5, silent=("site-04",))
    victim = "site-01"
    evil = replace(run.request, dropped=(*run.request.dropped, victim))
    client = run.clients["site-00"]
    with pytest.raises(UnmaskRefusedError, match=r"both shares of \['site-01'\]"):
        client.unmask(evil)
    assert client.stage is Stage.ABORTED
    with pytest.raises(StageError):  # no second chance, not even for the honest request
        client.unmask(run.request)


def test_request_dropping_a_signed_survivor_is_refused() -> None:
    run = _run_to_unmask(5)
    victim = "site-02"
    survivors = tuple(s for s in run.request.survivors if s != victim)
    evil = replace(run.request, survivors=survivors, dropped=(victim,))
    with pytest.raises(UnmaskRefusedError, match="differs from the one this client signed"):
        run.clients["site-00"].unmask(evil)


def test_signatures_on_another_survivor_list_are_refused() -> None:
    """Split view: the server shows the target a U3 without the victim (to collect mask-key shares
    of the victim there and self-mask shares elsewhere); the other survivors' signatures are on
    the full U3, so they do not verify on the target's list."""
    fed = make_federation(n=5)
    server, clients, u3 = _run_to_consistency(fed)
    target, victim = "site-00", "site-03"
    split = ConsistencyRequest(u3.round_id, tuple(s for s in u3.survivors if s != victim))
    own = clients[target].consistency_check(split)
    others = [clients[s].consistency_check(u3) for s in u3.survivors if s != target]
    evil = UnmaskRequest(u3.round_id, split.survivors, (victim,), ("gram", "b"), (own, *others))
    with pytest.raises(UnmaskRefusedError, match="not on the survivor list this client signed"):
        clients[target].unmask(evil)
    assert server.stage.value == "consistency-check"


def test_too_few_consistency_signatures_are_refused() -> None:
    run = _run_to_unmask(5)
    t = run.fed.config.t
    evil = replace(run.request, signatures=run.request.signatures[: t - 1])
    with pytest.raises(UnmaskRefusedError, match=f"fewer than t={t}"):
        run.clients["site-01"].unmask(evil)
    forged = replace(
        run.request.signatures[0], signature=bytes(64)
    )  # a bad signature under a real name
    evil = replace(run.request, signatures=(forged, *run.request.signatures[1:]))
    with pytest.raises(UnmaskRefusedError, match="not on the survivor list"):
        run.clients["site-02"].unmask(evil)


def test_t_valid_consistency_signatures_suffice_and_a_repeated_or_outside_signer_is_refused() -> (
    None
):
    """The client verifies t signatures (M-10) and no more: a bad signature after the t-th is
    neither verified nor counted, so the unmask goes on; one among the first t refuses, and so
    does a list naming a signer twice or a non-survivor, wherever it stands."""
    run = _run_to_unmask(7)
    t = run.fed.config.t
    assert len(run.request.signatures) > t
    sigs = run.request.signatures
    tail_forged = replace(sigs[t], signature=bytes(64))
    late = replace(run.request, signatures=(*sigs[:t], tail_forged, *sigs[t + 1 :]))
    assert run.clients["site-00"].unmask(late).shares  # answered: t valid ones came first
    early = replace(run.request, signatures=(*sigs[: t - 1], tail_forged, *sigs[t - 1 : t]))
    with pytest.raises(UnmaskRefusedError, match="not on the survivor list"):
        run.clients["site-01"].unmask(early)
    repeated = replace(run.request, signatures=(*sigs, sigs[0]))
    with pytest.raises(UnmaskRefusedError, match="not a distinct survivor"):
        run.clients["site-02"].unmask(repeated)
    stranger = replace(sigs[-1], site_id="site-99")
    outside = replace(run.request, signatures=(*sigs, stranger))
    with pytest.raises(UnmaskRefusedError, match="not a distinct survivor"):
        run.clients["site-03"].unmask(outside)


def test_dropped_list_must_be_u2_minus_u3() -> None:
    run = _run_to_unmask(5, silent=("site-04",))
    evil = replace(run.request, dropped=())  # hides a drop-out
    with pytest.raises(UnmaskRefusedError, match="U2"):
        run.clients["site-00"].unmask(evil)


def test_self_masks_of_a_release_below_its_minimum_are_refused() -> None:
    ids = [f"site-{i:02d}" for i in range(6)]
    plan = [("gram", ids, 6, 1e4), ("b/rare", ids[:3], 3, 1.0)]
    fed = make_federation(n=6, releases=plan)
    run = _run_to_unmask_fed(fed, silent=("site-00",))
    assert run.request.releases == ("gram",)
    evil = replace(run.request, releases=("gram", "b/rare"))
    with pytest.raises(UnmaskRefusedError, match="b/rare"):
        run.clients["site-01"].unmask(evil)


def test_a_member_refuses_a_lowered_release_threshold_whatever_the_plan_says() -> None:
    # The coordinator signed t_R = 1 for a 3-member release and dropped two of its members: the
    # state machine alone would reveal (1 >= t_R); a member whose policy floor is 3 refuses.
    ids = [f"site-{i:02d}" for i in range(6)]
    fed = make_federation(n=6, releases=[("gram", ids, 6, 1e4), ("b/rare", ids[:3], 3, 1.0)])
    lowered = ReleaseSpec("b/rare", tuple(ids[:3]), 3, 1.0, threshold=1)
    fed.config = replace(fed.config, releases=(fed.config.releases[0], lowered))
    guarded = {"site-00": {"b/rare": 3, "gram": 3}}
    run = _run_to_unmask_fed(fed, silent=("site-01", "site-02"), floors=guarded)
    assert set(run.request.releases) == {"b/rare", "gram"}  # what the coordinator asks for
    with pytest.raises(
        UnmaskRefusedError, match="'b/rare' has 1 survivors, fewer than its minimum 3"
    ):
        run.clients["site-00"].unmask(run.request)
    # A client without the floor (only the plan's t_R) reveals the lone member's seed share.
    unguarded = _run_to_unmask_fed(fed, silent=("site-01", "site-02"))
    shares = unguarded.clients["site-00"].unmask(unguarded.request).shares
    assert any(r.release == "b/rare" and r.owner == "site-00" for r in shares)


def test_honest_request_reveals_one_kind_per_peer() -> None:
    run = _run_to_unmask(5, silent=("site-04",))
    response = run.clients["site-00"].unmask(run.request)
    kinds: dict[str, set[str]] = {}
    for item in response.shares:
        kinds.setdefault(item.owner, set()).add(item.kind)
    assert kinds["site-04"] == {"mask-key"}
    assert all(kinds[s] == {"self-mask"} for s in run.request.survivors)


def test_client_rejects_forged_directory_and_tampered_shares() -> None:
    fed = make_federation(n=4)
    clients = honest_clients(fed)
    adverts = [c.advertise_keys() for c in clients.values()]
    swapped = replace(adverts[1], enc_public=adverts[2].enc_public)  # server swaps a key
    with pytest.raises(ProtocolError, match="does not verify"):
        clients["site-00"].share_keys(KeyDirectory("round-0001", (adverts[0], swapped)))
    directory = KeyDirectory("round-0001", tuple(adverts))
    uploads = {s: clients[s].share_keys(directory) for s in ("site-01", "site-02", "site-03")}
    to_one = [e for u in uploads.values() for e in u.shares if e.recipient == "site-01"]
    assert len(to_one) == 2
    bad = EncryptedShare(
        to_one[0].sender,
        "site-01",
        to_one[0].ciphertext[:-1] + bytes([to_one[0].ciphertext[-1] ^ 1]),
    )
    with pytest.raises(ProtocolError, match="share bundle"):
        clients["site-01"].masked_input(RoutedShares("round-0001", "site-01", (bad, to_one[1])))
    assert clients["site-01"].stage is Stage.ABORTED
    # A survivor list that omits a client which uploaded is refused at ConsistencyCheck.
    c2 = clients["site-02"]
    to_two = tuple(e for u in uploads.values() for e in u.shares if e.recipient == "site-02")
    c2.masked_input(RoutedShares("round-0001", "site-02", to_two))
    with pytest.raises(ProtocolError, match="omits this client"):
        c2.consistency_check(ConsistencyRequest("round-0001", ("site-01", "site-03")))


def test_server_detects_a_corrupted_mask_key_share() -> None:
    """A lying client (wrong share of a dropped site's s_sk): the reconstructed key does not match
    the signed advert, so the server aborts instead of releasing a wrong sum."""
    run = _run_to_unmask(5, silent=("site-04",))
    for s in run.request.survivors:
        response = run.clients[s].unmask(run.request)
        if s == "site-00":
            bad = [
                replace(item, share=Share(item.share.index, (item.share.value + 1) % PRIME))
                if item.kind == "mask-key"
                else item
                for item in response.shares
            ]
            response = replace(response, shares=tuple(bad))
        run.server.receive(response, sender=s)
    with pytest.raises(RoundAbortedError, match="does not match its advert"):
        run.server.close_unmask()
    assert run.server.result is None and run.server.held_sums == {}
