"""What a site in the Flower app leaves to afl's own daemons (docs/flower.md §7): it refuses a
sparse-graph plan and an evaluation round's plan in one line, and passes every other decision
through unchanged."""

from __future__ import annotations

from afl.client.policy.plan import PolicyDecision
from afl.flower.site import within_the_app
from afl.proto.v1 import common_pb2 as cpb

ACCEPTED = PolicyDecision(True, audit={"releases": 1})


def _plan(kind: int = cpb.STATISTIC_KIND_GRAM, degree: int = 0) -> cpb.ReleasePlan:
    plan = cpb.ReleasePlan(aggregation=cpb.AGGREGATION_MODE_MASK)
    plan.releases.add(name="r", kind=kind, member_site_ids=["a", "b", "c"])
    plan.mask_graph.degree = degree
    return plan


def test_a_full_graph_training_plan_keeps_the_sites_decision() -> None:
    assert within_the_app(_plan(), ACCEPTED) is ACCEPTED


def test_a_sparse_graph_plan_is_refused_naming_afl_client() -> None:
    decision = within_the_app(_plan(degree=4), ACCEPTED)
    assert not decision.accept
    assert "sparse-graph plan needs afl-client" in decision.reason
    assert decision.audit == ACCEPTED.audit


def test_an_evaluation_plan_is_refused_naming_afl_client() -> None:
    decision = within_the_app(_plan(kind=cpb.STATISTIC_KIND_SCORE_HISTOGRAM), ACCEPTED)
    assert not decision.accept
    assert "evaluation rounds" in decision.reason
