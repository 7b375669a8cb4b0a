"""`bench --edge-profiles` on a tiny byte-level model: each profile's child reports memory, compute and agreement."""

from splitlm.bench.edge_profiles import markdown, private_edge, run_profile
from splitlm.cloud.server import BackgroundServer
from splitlm.model.onnx_export import export_edge_onnx
from splitlm.model.shards import load_edge, split_model


def test_profiles_report_memory_compute_and_agreement(audit_model_dir, tmp_path):
    split = split_model(str(audit_model_dir), head=2, tail=2, out=tmp_path / "split")
    edge_dir = private_edge(split / "edge", tmp_path / "private")
    export_edge_onnx(load_edge(edge_dir), edge_dir)
    assert not (split / "edge" / "onnx").exists()  # the export went into the private copy
    prompts = [{"prompt": "hello there", "chat": False}]
    with BackgroundServer(split / "cloud") as server:
        ref = run_profile("torch-fp32", edge_dir, server.url, prompts, 6, 1, None)
        onnx = run_profile("onnx-fp32", edge_dir, server.url, prompts, 6, 1, ref["tokens_none"])
    for row in (ref, onnx):
        assert "error" not in row, row
        assert row["peak_rss_mb"] >= row["loaded_rss_mb"] > row["baseline_rss_mb"] > 0
        assert row["step_ms"]["decode_1"] > 0 and row["step_ms"]["tree_16"] > 0
        assert len(row["tokens_none"][0]) == len(row["tokens_auto"][0]) == 6
    assert onnx["tokens_none"] == ref["tokens_none"] and onnx["teacher_forced"]["agreement"] == 1.0
    table = markdown({"profiles": {"torch-fp32": ref, "onnx-fp32": onnx, "onnx-int8": {"error": "boom"}}})
    assert "| onnx-int8 | error: boom" in table and table.count("\n") == 4
