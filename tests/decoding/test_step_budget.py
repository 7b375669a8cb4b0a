"""StepBudget.choose: the tree size (about) maximising expected tokens per second, from the measured
round trip, the fitted compute cost per token and the calibrated acceptance of drafted nodes."""

import pytest

from splitlm.decoding.budget import StepBudget
from splitlm.decoding.tree import TokenTree

# root; a (score 0.9) under it and b (0.9) under a; c (0.2) under the root and d (0.9) under c.
# Before any acceptance is seen, a score s in bin b counts as P(accept) = (b + 0.5) / 10:
# 0.9 -> 0.95 and 0.2 -> 0.25, so the reach (the product along the path) is
# a 0.95, b 0.9025, c 0.25, d 0.2375.
TREE = TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 0, 3], [1.0, 0.9, 0.9, 0.2, 0.9])


def budget(rtt_s: float, c0: float, c1: float, **kw) -> StepBudget:
    b = StepBudget(**kw)
    for t in (1, 5, 20, 40):  # compute = c0 + c1 * tokens exactly: the fit recovers c0, c1
        b.observe_step(t, c0 + c1 * t, rtt_s)
    for _ in range(20):  # the link average settles on rtt_s
        b.observe_network(rtt_s)
    return b


def test_reach_is_the_product_along_the_path():
    choice = budget(0.08, 0.002, 0.0001).choose(TREE)
    assert choice.reach == pytest.approx([1.0, 0.95, 0.95 * 0.95, 0.25, 0.25 * 0.95])


def test_free_compute_sends_every_node():
    choice = budget(0.08, 0.002, 0.0001).choose(TREE)
    assert choice.nodes == 5
    assert choice.expected_tokens == pytest.approx(1 + 0.95 + 0.9025 + 0.25 + 0.2375)
    assert choice.predicted_step_s == pytest.approx(0.08 + 0.002 + 0.0001 * 5)


def test_costly_compute_stops_where_a_node_no_longer_pays():
    # 50 ms per token: root 1/0.07 = 14.3 tok/s; + a 1.95/0.12 = 16.3; + b 2.85/0.17 = 16.8;
    # + c 3.10/0.22 = 14.1. The best tree is root, a, b: the likeliest nodes, a subtree.
    choice = budget(0.01, 0.01, 0.05).choose(TREE)
    assert choice.nodes == 3
    assert choice.expected_tokens == pytest.approx(1 + 0.95 + 0.9025)
    assert choice.predicted_step_s == pytest.approx(0.01 + 0.01 + 0.05 * 3)


def test_prohibitive_compute_sends_the_root_alone():
    # a node costs 0.5 s and brings < 1 token (with no lean: 2 and 3 nodes come within 2 % of the root's rate)
    choice = budget(0.01, 0.01, 0.5, lean=0.0).choose(TREE)
    assert choice.nodes == 1 and choice.expected_tokens == 1.0


def test_extra_tokens_count_in_the_step_time():
    b = budget(0.01, 0.01, 0.05, lean=0.0)  # root, a, b: the best rate (with the 5 % lean, 4 nodes)
    assert b.choose(TREE, extra_tokens=4).predicted_step_s == pytest.approx(0.02 + 0.05 * (3 + 4))


def test_rejections_seen_shrink_the_tree():
    b = budget(0.01, 0.01, 0.05)
    for _ in range(20):  # a and c tested (their parent, the root, was accepted) and rejected every time
        b.observe_acceptance(TREE, [0])
    assert b.calibration.p(0.9) == pytest.approx(2 * 0.95 / 22)
    assert b.choose(TREE).nodes == 1


def test_fixed_nodes_ignores_the_cost_and_caps_at_the_tree():
    assert budget(0.01, 0.01, 0.5, fixed_nodes=3).choose(TREE).nodes == 3
    assert budget(0.01, 0.01, 0.5, fixed_nodes=64).choose(TREE).nodes == 5
    assert budget(0.08, 0.002, 0.0001, max_nodes=2).choose(TREE).nodes == 2


def test_drafting_time_counts_in_the_step_time_and_makes_larger_trees_pay():
    # 50 ms per token, as in test_costly_compute_stops_where_a_node_no_longer_pays (3 nodes). With
    # 1 s of drafting around every pass the whole tree pays: 3.34/1.27 = 2.63 tok/s against
    # 2.85/1.17 = 2.44 for root, a, b.
    b = budget(0.01, 0.01, 0.05)
    for _ in range(60):  # the overhead average settles on what is observed
        b.observe_step(3, 0.01 + 0.05 * 3, 0.01, overhead_s=1.0)
    choice = b.choose(TREE)
    assert b.overhead_s == pytest.approx(1.0, rel=1e-4)
    assert choice.predicted_step_s == pytest.approx(0.01 + 1.0 + 0.01 + 0.05 * choice.nodes, rel=1e-3)
    assert choice.nodes == 5


def test_lean_sends_the_largest_tree_within_its_share_of_the_best_rate():
    # 20 ms per token: root 1/0.04 = 25 tok/s; + a 32.5; + b 35.7 (the best); + c 3.10/0.10 = 31.0;
    # + d 3.34/0.12 = 27.8. Within 15 % of the best (30.3) the largest is 4 nodes; with no lean, 3.
    assert budget(0.01, 0.01, 0.02, lean=0.0).choose(TREE).nodes == 3
    assert budget(0.01, 0.01, 0.02, lean=0.05).choose(TREE).nodes == 3
    assert budget(0.01, 0.01, 0.02, lean=0.15).choose(TREE).nodes == 4


def split_budget(edge_c0: float, edge_c1: float, cloud_c0: float = 0.01, cloud_c1: float = 0.002) -> StepBudget:
    """A budget fed steps whose compute is a cloud part and an edge part, the edge's reported apart."""
    b = StepBudget(explore_every=10**6)
    for _ in range(3):
        for t in (1, 2, 3, 4, 5):  # every bucket the tree's sizes fall in, measured (count >= 2)
            edge = edge_c0 + edge_c1 * t
            b.observe_step(t, cloud_c0 + cloud_c1 * t + edge, 0.05, 0.0, edge_s=edge)
    return b


def test_the_edge_and_the_cloud_are_learned_apart_from_the_steps():
    b = split_budget(0.004, 0.03)
    assert b.edge.c0 == pytest.approx(0.004) and b.edge.c1 == pytest.approx(0.03)
    assert b.compute.c0 == pytest.approx(0.01) and b.compute.c1 == pytest.approx(0.002)
    est = b.estimate()
    assert (est.edge_c0_s, est.edge_c1_s, est.compute_c1_s) == pytest.approx((0.004, 0.03, 0.002))
    assert b.step_time(4) == pytest.approx(0.05 + 0.004 + 0.03 * 4 + 0.01 + 0.002 * 4)


def test_a_slow_edge_gets_smaller_trees():
    # the same link (50 ms), cloud (10 ms + 2 ms per token) and drafts; only the edge's per-token cost
    # differs: 0.1 ms (the whole tree pays) against 60 ms (an LM head of 128k rows on a laptop CPU)
    fast, slow = split_budget(0.002, 0.0001), split_budget(0.002, 0.06)
    assert fast.choose(TREE).nodes == 5
    assert slow.choose(TREE).nodes < fast.choose(TREE).nodes


def test_an_edge_measured_slower_online_shrinks_the_trees():
    b = split_budget(0.002, 0.0001)
    before = b.choose(TREE).nodes
    for _ in range(40):  # the edge slows down (another process took its core): its term follows
        for t in (1, 2, 3, 4, 5):
            edge = 0.002 + 0.06 * t
            b.observe_step(t, 0.01 + 0.002 * t + edge, 0.05, 0.0, edge_s=edge)
    assert b.edge.predict(5) > 0.25
    assert b.compute.predict(5) == pytest.approx(0.02, rel=0.05)  # the cloud's term did not move
    assert b.choose(TREE).nodes < before


def test_a_step_without_edge_timings_counts_all_its_compute_as_the_clouds():
    b = budget(0.08, 0.002, 0.0001)
    assert b.edge.predict(40) == 0.0
    assert b.step_time(5) == pytest.approx(0.08 + 0.002 + 0.0001 * 5)
