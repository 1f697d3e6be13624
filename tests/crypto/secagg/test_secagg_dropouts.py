"""Drop-outs at every stage of the secure-aggregation round (docs/protocol.md §4.2): up to n - t
drop-outs the round completes with exactly the survivors' sums; one more aborts with a clear reason
and no release; a sub-cohort release below its minimum is withheld while the others are released."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afl.crypto.errors import RoundAbortedError, StageError
from afl.crypto.secagg.local import LocalRoundReport, run_local_round
from afl.crypto.secagg.messages import Stage
from tests.crypto.secagg_helpers import (
    assert_sum_matches,
    exact_sum,
    honest_round,
    make_federation,
    site_ids,
)

N = 7  # t = 4: up to 3 drop-outs


def _check_survivor_sums(
    fed_n: int, drops: dict[str, Stage], *, expect_dropped: set[str]
) -> LocalRoundReport:
    fed = make_federation(n=fed_n, seed=len(drops))
    report = run_local_round(
        config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
    )
    result = report.result
    uploaded = (Stage.CONSISTENCY, Stage.UNMASK)  # gone after their upload: in U3
    survivors = [s for s in fed.config.cohort if s not in drops or drops[s] in uploaded]
    assert list(result.survivors) == survivors
    assert set(result.dropped) == expect_dropped
    for name in ("gram", "b"):
        spec = fed.config.release(name)
        assert result.contributors[name] == tuple(survivors)
        assert_sum_matches(result.sums[name], exact_sum(fed.inputs, name, survivors), spec.codec())
    return report


@pytest.mark.parametrize(
    "stage",
    [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.CONSISTENCY],
    ids=["after-advertise", "after-share-keys", "after-masked-input"],
)
def test_up_to_threshold_dropouts_give_exact_survivor_sums(stage: Stage) -> None:
    drops = {s: stage for s in site_ids(N)[1:4]}  # 3 = n - t drop-outs
    # Sites gone after ShareKeys are in U2 \ U3 (their pairwise masks are recovered from s_sk
    # shares); sites gone before ShareKeys never entered anyone's masks; sites gone after
    # MaskedInput are in U3 and their inputs count (self masks recovered from b shares).
    expect = set(drops) if stage is Stage.MASKED_INPUT else set()
    _check_survivor_sums(N, drops, expect_dropped=expect)


def test_dropouts_during_unmask_keep_every_upload() -> None:
    drops = {s: Stage.UNMASK for s in site_ids(N)[:3]}  # signed U3, then vanished
    report = _check_survivor_sums(N, drops, expect_dropped=set())
    assert report.server.stage is Stage.DONE


def test_mixed_dropouts_across_stages() -> None:
    ids = site_ids(9)  # t = 5: up to 4 drop-outs, spread over the stages
    drops = {
        ids[0]: Stage.MASKED_INPUT,
        ids[4]: Stage.MASKED_INPUT,
        ids[8]: Stage.CONSISTENCY,
        ids[5]: Stage.UNMASK,
    }
    _check_survivor_sums(9, drops, expect_dropped={ids[0], ids[4]})


@pytest.mark.parametrize(
    ("stage", "where"),
    [
        (Stage.ADVERTISE, "advertise-keys"),
        (Stage.SHARE_KEYS, "share-keys"),
        (Stage.MASKED_INPUT, "masked-input"),
        (Stage.CONSISTENCY, "consistency-check"),
        (Stage.UNMASK, "unmask"),
    ],
)
def test_one_dropout_too_many_aborts_with_no_release(stage: Stage, where: str) -> None:
    fed = make_federation(n=N)
    drops = {s: stage for s in site_ids(N)[:4]}  # 4 > n - t = 3
    with pytest.raises(RoundAbortedError, match=rf"{where}: only 3 of 7 .* threshold t=4"):
        run_local_round(
            config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
        )


def test_aborted_server_releases_nothing_and_accepts_nothing() -> None:
    fed = make_federation(n=5)
    server, clients = honest_round(fed)
    for s in fed.config.cohort:
        server.receive(clients[s].advertise_keys(), sender=s)
    directory = server.close_advertise()
    for s in fed.config.cohort:
        server.receive(clients[s].share_keys(directory), sender=s)
    routed = server.close_share_keys()
    for s in fed.config.cohort[:2]:  # t = 3; only 2 upload
        server.receive(clients[s].masked_input(routed[s]), sender=s)
    with pytest.raises(RoundAbortedError, match="nothing released"):
        server.close_masked_input()
    assert server.stage is Stage.ABORTED and server.result is None
    assert server.abort_reason is not None and "masked-input" in server.abort_reason
    assert server.held_sums == {}
    late = clients[fed.config.cohort[2]].masked_input(routed[fed.config.cohort[2]])
    with pytest.raises(StageError, match="aborted"):
        server.receive(late, sender=fed.config.cohort[2])


def test_sub_cohort_release_below_its_minimum_is_withheld() -> None:
    ids = site_ids(7)
    plan = [("gram", ids, 10, 1e4), ("b/rare", ids[:3], 4, 1.0), ("b/common", ids[2:], 4, 1.0)]
    fed = make_federation(n=7, releases=plan, seed=5)
    drops = {ids[0]: Stage.MASKED_INPUT}  # "b/rare" keeps 2 < 3 survivors
    result = run_local_round(
        config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
    ).result
    assert set(result.sums) == {"gram", "b/common"}
    assert (
        "b/rare" in result.withheld
        and "fewer than the release minimum 3" in (result.withheld["b/rare"])
    )
    survivors = ids[1:]
    for name, members in (("gram", survivors), ("b/common", ids[2:])):
        spec = fed.config.release(name)
        assert_sum_matches(result.sums[name], exact_sum(fed.inputs, name, members), spec.codec())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(min_value=3, max_value=6),
    schedule=st.lists(st.sampled_from(list(Stage)[:5]), min_size=6, max_size=6),
    dropping=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_property_any_dropout_schedule(n: int, schedule: list[Stage], dropping: list[bool]) -> None:
    """The round completes iff at least t sites stay to the end; the sums are then exactly those
    of U3 (sites whose masked input arrived), otherwise it aborts with no result."""
    fed = make_federation(n=n)
    ids = list(fed.config.cohort)
    drops = {s: schedule[i] for i, s in enumerate(ids) if dropping[i]}
    if n - len(drops) < fed.config.t:
        with pytest.raises(RoundAbortedError, match="fewer than the threshold"):
            run_local_round(
                config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
            )
        return
    result = run_local_round(
        config=fed.config, identity_keys=fed.keys, inputs=fed.inputs, drop_before=drops
    ).result
    uploaded = (Stage.CONSISTENCY, Stage.UNMASK)
    u3 = [s for s in ids if s not in drops or drops[s] in uploaded]
    assert list(result.survivors) == u3
    assert set(result.dropped) == {s for s, st_ in drops.items() if st_ is Stage.MASKED_INPUT}
    for name in ("gram", "b"):
        spec = fed.config.release(name)
        if len(u3) < spec.min_survivors:
            assert name in result.withheld and name not in result.sums
        else:
            assert_sum_matches(result.sums[name], exact_sum(fed.inputs, name, u3), spec.codec())
