"""Pieces of the Ray cloud that need no Ray: stage ranges, the cache edits a later stage repeats, the CLI flags."""

import pytest
import torch

from splitlm import SplitLMError
from splitlm.cli import main
from splitlm.cloud.ray_stage import StageCache, apply_edits, stage_ranges
from splitlm.model.kv_cache import KVCache


def test_stage_ranges_are_contiguous_and_even():
    assert stage_ranges(2, 28, 2) == [(2, 15), (15, 28)]
    assert stage_ranges(2, 7, 3) == [(2, 4), (4, 6), (6, 7)]
    with pytest.raises(SplitLMError, match="--stages must be in"):
        stage_ranges(2, 4, 3)


def append(cache: KVCache, t: int, g: torch.Generator, start_pos: int) -> None:
    """One forward's append of t entries to layer 0 (what the layers do, on each stage)."""
    cache.begin(t, torch.arange(start_pos, start_pos + t))
    cache.update(0, torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g))


def test_a_later_stage_repeating_the_edits_holds_the_same_entries():
    """Stage 0's StageCache records clear, crop, keep, retain_last and the pending block; a plain cache that
    repeats them (with the same appends) ends with the same positions, length and pending block."""
    head, later = StageCache(1, sid=7), KVCache(1)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    steps = [
        lambda c: c.keep([1, 0]),
        lambda c: c.crop(3),
        lambda c: c.retain_last(4),
        lambda c: c.clear(),
        lambda c: setattr(c, "pending_start", c.length - 1),
    ]
    for i, edit in enumerate(steps * 2):
        append(head, 3, g1, 10 * i)
        apply_edits(later, head.drain())
        append(later, 3, g2, 10 * i)
        edit(head)
        assert head.edits, "the edit was not recorded"
    apply_edits(later, head.drain())
    assert (later.length, later.pending_start) == (head.length, head.pending_start)
    assert torch.equal(later.positions, head.positions)
    k_head, k_later = head.view(0), later.view(0)
    assert (k_head is None) == (k_later is None)
    if k_head is not None:
        assert torch.equal(k_head[0], k_later[0])


@pytest.mark.parametrize("flags", [["--stages", "2"], ["--replicas", "2"], ["--lanes", "2"]])
def test_ray_flags_without_ray_are_refused(tiny_split, capsys, flags):
    assert main(["serve-cloud", "--shard", str(tiny_split / "cloud"), *flags]) == 1
    assert "need --ray" in capsys.readouterr().err
