"""Secure aggregation over a sparse masking graph (SecAgg+; docs/protocol.md §4.2 "Sparse
graph"), the transport-free state machines: with up to D = n - t drop-outs at any stage after
AdvertiseKeys the survivors' exact sums are released; one more aborts with nothing released; a
missing advert aborts (the graph is never drawn from a subset of the nonces); every party derives
the same graph, and shares and masks stay within it; a nonce that does not open its commitment, an
advert made for another commitment list, and a share from a non-neighbour are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afl.crypto.errors import ProtocolError, RoundAbortedError, SecAggConfigError
from afl.crypto.identity.signatures import sign_fields
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig, SparseGraph
from afl.crypto.secagg.graph import graph_commitment, new_graph_nonce
from afl.crypto.secagg.local import run_local_round
from afl.crypto.secagg.messages import ADVERTISE_CONTEXT, KeyDirectory, Stage, signed_advert_fields
from afl.crypto.secagg.server import SecAggServer
from afl.crypto.secagg.unmask import expected_reveals
from tests.crypto.secagg_helpers import (
    Federation,
    assert_sum_matches,
    exact_sum,
    make_federation,
    site_ids,
)

AFTER_ADVERTISE = (
    Stage.SHARE_KEYS,
    Stage.MASKED_INPUT,
    Stage.CONSISTENCY,
    Stage.UNMASK,
)


def _sparse(n: int, *, k: int, dropouts: int, seed: int = 0) -> Federation:
    """n sites, H(n, k), t_N = k - D (every secret keeps t_N holders after any D drop-outs)."""
    graph = SparseGraph(degree=k, share_threshold=k - dropouts, colluders=0)
    return make_federation(n=n, threshold=n - dropouts, graph=graph, seed=seed)


class _Parties:
    """Nonces, commitments, the server and honest clients of a sparse round, before any message."""

    def __init__(self, fed: Federation) -> None:
        config = fed.config
        self.fed = fed
        self.nonces = {s: new_graph_nonce() for s in config.cohort}
        self.commitments = {
            s: graph_commitment(round_id=config.round_id, site_id=s, nonce=v)
            for s, v in self.nonces.items()
        }
        identities = {s: k.public_key() for s, k in fed.keys.items()}
        self.server = SecAggServer(
            config=config, identities=identities, commitments=self.commitments
        )
        self.clients = {
            s: SecAggClient(
                site_id=s,
                identity_key=fed.keys[s],
                config=config,
                identities=identities,
                inputs=fed.inputs[s],
                graph_nonce=self.nonces[s],
            )
            for s in config.cohort
        }

    def advertise(self) -> KeyDirectory:
        for s, c in self.clients.items():
            self.server.receive(c.advertise_keys(self.commitments), sender=s)
        return self.server.close_advertise()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_sparse_masked_sums_equal_the_plaintext_survivor_sums(data: st.DataObject) -> None:
    n = data.draw(st.integers(6, 16), label="n")
    k = 2 * data.draw(st.integers(2, (n - 2) // 2), label="k/2")
    dropouts = data.draw(st.integers(0, min(3, k - 2)), label="D")
    fed = _sparse(n, k=k, dropouts=dropouts, seed=data.draw(st.integers(0, 99)))
    gone = data.draw(st.lists(st.sampled_from(fed.config.cohort), max_size=dropouts, unique=True))
    drops = {s: data.draw(st.sampled_from(AFTER_ADVERTISE)) for s in gone}
    report = run_local_round(
        config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
    )
    uploaded = (Stage.CONSISTENCY, Stage.UNMASK)
    survivors = [s for s in fed.config.cohort if s not in drops or drops[s] in uploaded]
    assert list(report.result.survivors) == survivors
    for name in ("gram", "b"):
        assert report.result.contributors[name] == tuple(survivors)
        spec = fed.config.release(name)
        expected = exact_sum(fed.inputs, name, survivors)
        assert_sum_matches(report.result.sums[name], expected, spec.codec())


@pytest.mark.parametrize("stage", AFTER_ADVERTISE, ids=lambda s: s.value)
def test_one_dropout_past_the_bound_aborts_with_nothing_released(stage: Stage) -> None:
    fed = _sparse(12, k=6, dropouts=2)
    drops = dict.fromkeys(site_ids(12)[:3], stage)  # D + 1
    with pytest.raises(
        RoundAbortedError, match="fewer than the threshold t=10; round aborted, nothing released"
    ):
        run_local_round(
            config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
        )


def test_the_server_aborts_past_the_bound_and_keeps_no_vectors() -> None:
    parties = _Parties(_sparse(10, k=4, dropouts=1))
    directory = parties.advertise()
    for s, c in parties.clients.items():
        parties.server.receive(c.share_keys(directory), sender=s)
    routed = parties.server.close_share_keys()
    for s in parties.fed.config.cohort[2:]:  # two of ten gone, D = 1
        parties.server.receive(parties.clients[s].masked_input(routed[s]), sender=s)
    with pytest.raises(RoundAbortedError, match="threshold t=9; round aborted, nothing released"):
        parties.server.close_masked_input()
    assert parties.server.result is None and parties.server.held_sums == {}


def test_a_missing_advert_aborts_the_sparse_round() -> None:
    parties = _Parties(_sparse(10, k=4, dropouts=2))
    for s, c in list(parties.clients.items())[1:]:  # 9 >= t = 8, but site-00's nonce is missing
        parties.server.receive(c.advertise_keys(parties.commitments), sender=s)
    with pytest.raises(RoundAbortedError, match="no advert \\(graph nonce\\) from site-00"):
        parties.server.close_advertise()
    # A directory lacking a participant is refused by the sites too.
    alone = _Parties(_sparse(10, k=4, dropouts=2))
    adverts = [c.advertise_keys(alone.commitments) for c in alone.clients.values()]
    client = alone.clients["site-01"]
    with pytest.raises(RoundAbortedError, match="no graph nonce from \\['site-00'\\]"):
        client.share_keys(KeyDirectory(alone.fed.config.round_id, tuple(adverts[1:])))
    assert client.stage is Stage.ABORTED


def test_every_party_derives_one_graph_and_shares_and_masks_stay_in_it() -> None:
    parties = _Parties(_sparse(14, k=4, dropouts=1))
    directory = parties.advertise()
    graph = parties.server.neighbours
    assert graph is not None
    uploads = {s: c.share_keys(directory) for s, c in parties.clients.items()}
    for s, c in parties.clients.items():
        assert c.neighbours == graph[s] and len(graph[s]) == 4
        assert {item.recipient for item in uploads[s].shares} == graph[s]
        parties.server.receive(uploads[s], sender=s)
    routed = parties.server.close_share_keys()
    for s, bundle in routed.items():
        assert {item.sender for item in bundle.shares} == graph[s]
    # Unmask asks each responder for the shares it holds only (its neighbours' and its own).
    wanted = expected_reveals(
        parties.fed.config,
        survivors=parties.fed.config.cohort,
        dropped=(),
        releases=("gram", "b"),
        responder="site-00",
        neighbours=graph,
    )
    assert {owner for _, owner, _ in wanted} == graph["site-00"] | {"site-00"}


def test_share_bundles_for_a_non_neighbour_are_refused_by_the_server() -> None:
    parties = _Parties(_sparse(12, k=4, dropouts=1))
    directory = parties.advertise()
    upload = parties.clients["site-00"].share_keys(directory)
    graph = parties.server.neighbours
    assert graph is not None
    stranger = next(s for s in parties.fed.config.cohort if s not in graph["site-00"] | {"site-00"})
    moved = replace(upload.shares[0], recipient=stranger)
    with pytest.raises(ProtocolError, match="its neighbours"):
        parties.server.receive(
            replace(upload, shares=(moved, *upload.shares[1:])), sender="site-00"
        )


def test_a_share_from_a_non_neighbour_is_refused_by_the_site() -> None:
    parties = _Parties(_sparse(12, k=4, dropouts=1))
    directory = parties.advertise()
    uploads = {s: c.share_keys(directory) for s, c in parties.clients.items()}
    graph = parties.server.neighbours
    assert graph is not None
    victim = "site-00"
    stranger = next(s for s in parties.fed.config.cohort if s not in graph[victim] | {victim})
    for s, u in uploads.items():
        parties.server.receive(u, sender=s)
    routed = parties.server.close_share_keys()[victim]
    # The coordinator slips in a bundle "from" a non-neighbour (any sealed bytes will do: the
    # site refuses before it opens it).
    extra = replace(uploads[stranger].shares[0], recipient=victim)
    with pytest.raises(ProtocolError, match="not a neighbour"):
        parties.clients[victim].masked_input(replace(routed, shares=(*routed.shares, extra)))


def test_shares_withheld_from_a_site_make_it_abort_before_masking() -> None:
    """A coordinator that routes a site too few neighbours' shares would have it mask with
    (almost) only its self mask, which the neighbours reveal for a survivor: the site aborts when
    fewer than k - D neighbours' shares reach it, and masks with k - D."""
    parties = _Parties(_sparse(12, k=4, dropouts=1))
    directory = parties.advertise()
    for s, c in parties.clients.items():
        parties.server.receive(c.share_keys(directory), sender=s)
    routed = parties.server.close_share_keys()
    victim, other = "site-00", "site-01"
    assert len(routed[victim].shares) == 4
    with pytest.raises(RoundAbortedError, match="fewer than k - D = 3"):
        parties.clients[victim].masked_input(replace(routed[victim], shares=()))
    assert parties.clients[victim].stage is Stage.ABORTED
    # k - D = 3 of the 4 neighbours (one dropped out): the site masks.
    three = replace(routed[other], shares=routed[other].shares[:3])
    assert parties.clients[other].masked_input(three).vectors


def test_a_nonce_that_does_not_open_its_commitment_is_refused() -> None:
    """A colluder that re-chooses its nonce after seeing the others' (to steer the graph) is
    caught: its new nonce does not open the commitment it signed at plan review."""
    parties = _Parties(_sparse(10, k=4, dropouts=1))
    colluder, victim = "site-03", "site-00"
    adverts = {s: c.advertise_keys(parties.commitments) for s, c in parties.clients.items()}
    ground = replace(adverts[colluder], graph_nonce=new_graph_nonce())
    ground = replace(
        ground,
        signature=sign_fields(
            parties.fed.keys[colluder],
            context=ADVERTISE_CONTEXT,
            fields=signed_advert_fields(parties.fed.config, ground),
        ),
    )
    with pytest.raises(ProtocolError, match="does not open its commitment"):
        parties.server.receive(ground, sender=colluder)
    forged = KeyDirectory(
        parties.fed.config.round_id,
        tuple(ground if s == colluder else a for s, a in adverts.items()),
    )
    with pytest.raises(ProtocolError, match=f"nonce of '{colluder}' does not open"):
        parties.clients[victim].share_keys(forged)
    assert parties.clients[victim].stage is Stage.ABORTED


def test_adverts_made_for_another_commitment_list_are_refused() -> None:
    """The coordinator shows one site a list with another commitment for a colluder (it could
    then open it with a nonce chosen after the honest reveals): the digests in the adverts
    differ, so the other sites refuse the directory, and the server the advert."""
    parties = _Parties(_sparse(10, k=4, dropouts=1))
    twisted = {**parties.commitments, "site-03": b"\x00" * 32}
    adverts = {
        s: c.advertise_keys(twisted if s == "site-01" else parties.commitments)
        for s, c in parties.clients.items()
    }
    with pytest.raises(ProtocolError, match="binds other graph commitments"):
        parties.server.receive(adverts["site-01"], sender="site-01")
    directory = KeyDirectory(parties.fed.config.round_id, tuple(adverts.values()))
    with pytest.raises(ProtocolError, match="made for other graph commitments"):
        parties.clients["site-00"].share_keys(directory)


def test_a_client_refuses_commitments_that_omit_a_participant_or_change_its_own() -> None:
    parties = _Parties(_sparse(8, k=4, dropouts=1))
    client = parties.clients["site-00"]
    partial = {s: c for s, c in parties.commitments.items() if s != "site-05"}
    with pytest.raises(RoundAbortedError, match="missing for \\['site-05'\\]"):
        client.advertise_keys(partial)
    other = _Parties(_sparse(8, k=4, dropouts=1))
    with pytest.raises(ProtocolError, match="another one for this site"):
        other.clients["site-00"].advertise_keys({**other.commitments, "site-00": b"x" * 32})


def test_a_sparse_config_needs_whole_cohort_releases_and_valid_parameters() -> None:
    ids = site_ids(8)
    whole = ReleaseSpec("gram", tuple(ids), 4, 10.0)
    part = ReleaseSpec("b", tuple(ids[:5]), 4, 10.0)
    graph = SparseGraph(degree=4, share_threshold=3, colluders=0)

    def config(*releases: ReleaseSpec, g: SparseGraph = graph, t: int | None = 7) -> RoundConfig:
        return RoundConfig.create(round_id="r", cohort=ids, releases=releases, threshold=t, graph=g)

    with pytest.raises(SecAggConfigError, match="not over the whole cohort"):
        config(whole, part)
    for bad, why in (
        (SparseGraph(3, 2, 0), "even degree"),
        (SparseGraph(8, 2, 0), "even degree"),
        (SparseGraph(4, 5, 0), "neighbourhood threshold"),
        (SparseGraph(4, 1, 0), "neighbourhood threshold"),
    ):
        with pytest.raises(SecAggConfigError, match=why):
            config(whole, g=bad)
    with pytest.raises(SecAggConfigError, match="explicit round threshold"):
        config(whole, t=None)
    digest = config(whole).digest()
    assert digest != replace(config(whole), graph=SparseGraph(4, 4, 0)).digest()
    fed = _sparse(8, k=4, dropouts=1)
    with pytest.raises(ProtocolError, match="graph nonce is needed"):
        SecAggClient(
            site_id="site-00",
            identity_key=fed.keys["site-00"],
            config=fed.config,
            identities={s: k.public_key() for s, k in fed.keys.items()},
            inputs=fed.inputs["site-00"],
        )
