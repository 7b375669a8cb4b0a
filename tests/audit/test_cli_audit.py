"""`splitlm audit` and `splitlm harden` end to end on the tiny model, and their error messages."""

import json

import pytest
import torch

from splitlm.cli import main


@pytest.fixture()
def corpus_files(tmp_path, audit_docs):
    paths = []
    for i, doc in enumerate(audit_docs[:12]):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(doc)
        paths.append(str(path))
    return paths


def test_audit_writes_report_json_and_plot(audit_model_dir, corpus_files, tmp_path, capsys):
    out = tmp_path / "audit"
    code = main(
        [
            "audit",
            "--model",
            str(audit_model_dir),
            "--head",
            "1,2",
            "--corpus",
            *corpus_files,
            "--max-train-tokens",
            "2048",
            "--max-eval-tokens",
            "128",
            "--whitebox-tokens",
            "64",
            "--down-whitebox-tokens",
            "32",
            "--candidates",
            "16",
            "--seq-len",
            "16",
            "--probe-epochs",
            "1",
            "--defence",
            "none,quant:4,harden:2",
            "--output-prompts",
            "1",
            "--output-tokens",
            "8",
            "--output-tails",
            "1,2",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    assert code == 0
    doc = json.loads((out / "audit.json").read_text())
    assert {(r["head"], r["defence"]) for r in doc["rows"] if r["attack"] == "whitebox"} == {
        (k, d) for k in (1, 2) for d in ("none", "quant:4", "harden:2")
    }
    assert all({"head", "attack", "defence", "top1", "top5"} <= set(r) for r in doc["rows"])
    report = (out / "report.md").read_text()
    assert "## Uplink" in report and "| whitebox |" in report and "harden:2 (2 steps" in report
    assert "## Output leakage" in report and "## Metadata" in report
    assert (out / "audit.png").stat().st_size > 1000
    assert str(out / "report.md") in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--attacks", "nn,telepathy"], "unknown attack"),
        (["--head", "4"], "leaves no layer for the cloud"),
        (["--defence", "noise"], "unknown defence"),
        (["--corpus", "/nonexistent/file.txt"], "corpus file not found"),
    ],
)
def test_audit_bad_arguments(audit_model_dir, tmp_path, capsys, args, needle):
    code = main(["audit", "--model", str(audit_model_dir), "--out", str(tmp_path / "x"), "--head", "1", *args])
    assert code == 1
    assert needle in capsys.readouterr().err


def test_audit_bad_head_list(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--head", "1,x", "--out", "x"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_harden_writes_a_split_with_a_private_head(audit_model_dir, corpus_files, tmp_path, capsys):
    from splitlm.model.shards import load_cloud, load_edge, split_model
    from splitlm.model.weights import read_shard_state

    out = tmp_path / "hard"
    code = main(
        [
            "harden",
            "--model",
            str(audit_model_dir),
            "--head",
            "2",
            "--tail",
            "2",
            "--corpus",
            *corpus_files,
            "--steps",
            "3",
            "--max-train-tokens",
            "1024",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    assert code == 0
    result = json.loads((out / "harden.json").read_text())
    assert result["steps"] == 3 and 0.0 <= result["agreement"] <= 1.0 and result["uplink_distance"] > 0
    public = split_model(str(audit_model_dir), 2, 2, tmp_path / "public")
    hard_w, pub_w = read_shard_state(out / "edge"), read_shard_state(public / "edge")
    assert hard_w.keys() == pub_w.keys()
    changed = {k for k in pub_w if not torch.equal(hard_w[k], pub_w[k])}
    assert changed and all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in changed)
    assert load_edge(out / "edge").manifest.fingerprint == load_cloud(public / "cloud").manifest.fingerprint
