import pytest
import torch
import torch.nn.functional as F

from splitlm.model.greedy_head import GreedyHead


def full_argmax(h, w, cap=None, allowed=None):
    logits = F.linear(h, w)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -torch.inf)
    return logits.argmax(-1)


@pytest.mark.parametrize("screen", [True, False])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_screened_argmax_equals_full_head(screen, cap):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4000, 64, generator=g)
    h = torch.randn(37, 64, generator=g) * 3
    head = GreedyHead(w, cap, screen=screen)
    assert head.screen is screen
    assert torch.equal(head.argmax(h), full_argmax(h, w, cap))


def test_allowed_ids_only():
    g = torch.Generator().manual_seed(1)
    w, h = torch.randn(3000, 48, generator=g), torch.randn(20, 48, generator=g)
    allowed = torch.rand(3000, generator=g) < 0.1
    got = GreedyHead(w, screen=True).argmax(h, allowed)
    assert allowed[got].all()
    assert torch.equal(got, full_argmax(h, w, allowed=allowed))


def test_near_ties_bf16_cannot_separate_are_decided_in_fp32():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(500, 32, generator=g)
    h = torch.randn(8, 32, generator=g)
    best = full_argmax(h, w)
    for r in range(8):  # for each row, a column a hair above its winner (far below bf16 resolution)
        w[100 + r] = w[best[r]] + 1e-4 * h[r] / h[r].norm()
    w[200] = w[best[0]]  # an exact duplicate of row 0's winner, at a higher id
    want = full_argmax(h, w)
    assert (want == torch.arange(100, 108)).all()
    assert torch.equal(GreedyHead(w, screen=True).argmax(h), want)
    dup = torch.stack([w[50]] * 3)  # exact duplicates: the lowest id wins, as in torch.argmax
    w2 = torch.cat([torch.randn(10, 32, generator=g) * 0.01, dup])
    assert GreedyHead(w2, screen=True).argmax(w[50][None]).item() == 10


def test_near_ties_among_negative_logits_are_decided_in_fp32():
    # every logit negative, so the screen's floor is b / (1 - c), the other branch of g⁻¹: near ties
    # and the winner still come out as the fp32 head's
    g = torch.Generator().manual_seed(3)
    h = torch.rand(6, 32, generator=g) + 0.5
    w = -(torch.rand(800, 32, generator=g) + 0.1)
    best = full_argmax(h, w)
    for r in range(6):
        w[300 + r] = w[best[r]] + 1e-4 * h[r] / h[r].norm()
    want = full_argmax(h, w)
    assert (F.linear(h, w) < 0).all() and (want == torch.arange(300, 306)).all()
    got, top = GreedyHead(w, screen=True).candidates(h, k=4)
    assert torch.equal(got, want) and top.shape == (6, 4)


def test_non_fp32_weights_use_the_plain_head():
    w = torch.randn(100, 16).to(torch.bfloat16)
    head = GreedyHead(w, screen=True)
    assert not head.screen
    h = torch.randn(3, 16).to(torch.bfloat16)
    assert torch.equal(head.argmax(h), full_argmax(h, w))


def tail_and_argmax(edge, h, positions, new_mask=None, cache=None, rows=None, allowed=None) -> torch.Tensor:
    """The greedy token of each row, [T or len(rows)] (batch of one): `tail_and_logits(...)[0].argmax(-1)`
    over the `allowed` ids, through the edge's screened LM head."""
    return edge.greedy_head().argmax(edge.tail_normed(h, positions, new_mask, cache, rows)[0], allowed)


def test_edge_tail_and_argmax_matches_its_logits(tiny_split):
    from splitlm.model.shards import load_edge

    edge = load_edge(tiny_split / "edge")
    edge._greedy = GreedyHead(edge.head_weight.detach(), edge.cfg.final_logit_softcapping, screen=True)  # tiny: force
    h = torch.randn(1, 6, edge.cfg.hidden_size)
    pos = torch.arange(6)
    want = edge.tail_and_logits(h, pos, None, edge.tail.new_cache(), [1, 3, 5])[0].argmax(-1)
    got = tail_and_argmax(edge, h, pos, None, edge.tail.new_cache(), [1, 3, 5])
    assert torch.equal(got, want)
    allowed = torch.zeros(edge.cfg.vocab_size, dtype=torch.bool)
    allowed[::7] = True
    only = tail_and_argmax(edge, h, pos, None, edge.tail.new_cache(), None, allowed)
    assert only.shape == (6,) and allowed[only].all()


def test_screening_can_be_switched_by_environment(tiny_split, monkeypatch):
    from splitlm import SplitLMError
    from splitlm.model.shards import load_edge

    for value, screen in (("0", False), ("1", True)):
        monkeypatch.setenv("SPLITLM_SCREENED_HEAD", value)
        assert load_edge(tiny_split / "edge").greedy_head().screen is screen
    monkeypatch.setenv("SPLITLM_SCREENED_HEAD", "yes")
    with pytest.raises(SplitLMError, match="must be 0 or 1"):
        load_edge(tiny_split / "edge").greedy_head()


def test_a_nan_row_falls_back_to_the_plain_head():
    g = torch.Generator().manual_seed(3)
    w, h = torch.randn(300, 16, generator=g), torch.randn(3, 16, generator=g)
    h[1, 4] = float("nan")
    got = GreedyHead(w, screen=True).argmax(h)
    assert torch.equal(got, GreedyHead(w, screen=False).argmax(h))
