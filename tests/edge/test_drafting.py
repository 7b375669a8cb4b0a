from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig


def test_each_speculative_configuration_keeps_its_own_memory(tiny_split, tiny_server):
    """Past outputs never leak between configurations: `auto` and `auto` pipelined are two memories, so a
    bench's pipelined mode cannot retrieve the answer the plain mode gave to the same prompt."""
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        plain = edge.drafting.draft_memory(SpecConfig("auto"))
        assert edge.drafting.draft_memory(SpecConfig("auto")) is plain
        assert edge.drafting.draft_memory(SpecConfig("auto", pipeline=True)) is not plain
        assert edge.drafting.draft_memory(SpecConfig("auto", warmup=False)) is not plain
        assert (
            edge.drafting.draft_memory(SpecConfig("auto", memory="auto+json")) is not plain
        )  # a bench mode of its own


def test_budgets_are_kept_apart_like_memories_and_by_grammar(tiny_split, tiny_server):
    """A step budget's calibration and cost curve carry over between requests of one configuration only:
    a bench's modes (their own memories) and constrained requests (drafts the grammar let through are
    accepted more often at the same score) each learn their own."""
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        plain = edge.drafting.budgets(SpecConfig("auto"))
        assert edge.drafting.budgets(SpecConfig("auto")) is plain
        assert edge.drafting.budgets(SpecConfig("auto"), constrained=True) is not plain
        assert edge.drafting.budgets(SpecConfig("auto", memory="auto+json")) is not plain
        assert edge.drafting.budgets(
            SpecConfig("auto", memory="auto+json"), constrained=True
        ) is not edge.drafting.budgets(SpecConfig("auto", memory="auto+json"))


def test_a_configuration_without_the_head_drafts_without_the_shards_head(tiny_split, tiny_server, tmp_path):
    """`auto-nohead` (SpecConfig(head=False)): the shard's trained head is loaded for `auto` only."""
    import shutil

    import torch

    from splitlm.decoding.head import HEAD_FILE, DraftHead, save_head

    edge_dir = tmp_path / "edge"
    shutil.copytree(tiny_split / "edge", edge_dir)
    with Edge(edge_dir, tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        save_head(DraftHead(edge.drafting.model.cfg.hidden_size, 16, torch.arange(32)), edge_dir / HEAD_FILE)
        with_head = edge.drafting.draft_memory(SpecConfig("auto"))
        without = edge.drafting.draft_memory(SpecConfig("auto", head=False))
        assert with_head.head is not None and without.head is None and without is not with_head
