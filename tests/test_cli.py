"""The `splitlm` command: --json output, and one clear message (no traceback) for each mistake."""

import json
import subprocess
import sys

import pytest

from splitlm.cli import main


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "splitlm", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json(bundled_split, bundled_server, capsys):
    code = main(
        [
            "generate",
            "--edge",
            str(bundled_split / "edge"),
            "--cloud",
            bundled_server.url,
            "--prompt",
            "The sky is",
            "--max-new-tokens",
            "12",
            "--json",
            "--wire-dtype",
            "fp32",
            "--spec",
            "none",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 12
    for key in ("round_trips", "new_tokens", "prefill_s", "decode_s", "bytes_up", "bytes_down"):
        assert key in out["stats"]
    assert out["stats"]["round_trips"] == out["stats"]["new_tokens"]


@pytest.mark.slow
def test_generate_with_sampling_and_a_stop_string(bundled_split, bundled_server, capsys):
    def generate(*extra):
        assert (
            main(
                [
                    "generate",
                    "--edge",
                    str(bundled_split / "edge"),
                    "--cloud",
                    bundled_server.url,
                    "--prompt",
                    "Once upon a time",
                    "--max-new-tokens",
                    "10",
                    "--json",
                    "--ignore-eos",
                    *extra,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out)

    plain = generate("--temperature", "1.2", "--seed", "3")
    assert plain["stats"]["spec_mode"] == "auto (sampling)" and len(plain["token_ids"]) == 10
    # with an fp32 wire the tree passes and the sequential passes see the same logits (up to rounding):
    # the same seed gives the same tokens with or without speculation, whatever trees the budget sent.
    # (Over the default fp16 wire, passes of other shapes round a few activations differently, which
    # can move a sampled token across a boundary of the inverse CDF: docs/speculative.md.)
    a = generate("--temperature", "1.2", "--seed", "3", "--wire-dtype", "fp32")
    assert a["stats"]["spec_mode"] == "auto (sampling)" and len(a["token_ids"]) == 10
    assert (
        generate("--temperature", "1.2", "--seed", "3", "--wire-dtype", "fp32", "--spec", "none")["token_ids"]
        == a["token_ids"]
    )
    assert generate("--temperature", "1.2", "--seed", "3", "--wire-dtype", "fp32")["token_ids"] == a["token_ids"]
    stop = a["text"][len(a["text"]) // 2 :][:2]
    cut = generate("--temperature", "1.2", "--seed", "3", "--wire-dtype", "fp32", "--stop", stop)
    assert cut["text"] == a["text"][: a["text"].index(stop)] and cut["finish_reason"] == "stop"


def assert_clean_failure(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr


def test_split_unknown_model(tmp_path):
    assert_clean_failure(
        run_cli("split", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")), "model not found"
    )


def test_split_too_many_edge_layers(tiny_llama, tmp_path):
    assert_clean_failure(
        run_cli("split", "--model", str(tiny_llama), "--head", "4", "--tail", "2", "--out", str(tmp_path / "o")),
        "no layer for the cloud",
    )


def test_bad_arguments(tmp_path):
    assert_clean_failure(run_cli("split", "--model", "x", "--head", "zero", "--out", "o"), "expected an integer")
    assert_clean_failure(run_cli("generate", "--edge", "e"), "--prompt")
    assert_clean_failure(run_cli("frobnicate"), "invalid choice")


def test_generate_without_a_server(tiny_split):
    proc = run_cli("generate", "--edge", str(tiny_split / "edge"), "--cloud", "ws://127.0.0.1:9", "--prompt", "hi")
    assert_clean_failure(proc, "cannot reach the cloud")
    proc = run_cli(
        "generate",
        "--edge",
        str(tiny_split / "edge"),
        "--cloud",
        "ws://127.0.0.1:9",
        "--prompt",
        "hi",
        "--json-schema",
        str(tiny_split / "nope.json"),
    )
    assert_clean_failure(proc, "cannot read the JSON schema")  # before the cloud is dialled


def test_generate_with_a_mismatched_split(tiny_llama, tiny_server, tmp_path):
    from splitlm.model.shards import split_model

    other = split_model(str(tiny_llama), head=1, tail=1, out=tmp_path / "other")
    proc = run_cli("generate", "--edge", str(other / "edge"), "--cloud", tiny_server.url, "--prompt", "hi")
    assert_clean_failure(proc, "different splits")


def test_serve_cloud_with_a_missing_shard(tmp_path):
    assert_clean_failure(run_cli("serve-cloud", "--shard", str(tmp_path / "nope")), "shard directory not found")


def test_edge_shard_given_as_cloud(tiny_split):
    assert_clean_failure(run_cli("serve-cloud", "--shard", str(tiny_split / "edge")), "is the edge shard")


def test_serve_edge_and_chat_without_a_server(tiny_split, tmp_path):
    edge = str(tiny_split / "edge")
    assert_clean_failure(run_cli("serve-edge", "--edge", edge, "--cloud", "ws://127.0.0.1:9"), "cannot reach the cloud")
    assert_clean_failure(
        run_cli("serve-edge", "--edge", edge, "--api-key-file", str(tmp_path / "nope")), "cannot read the API key file"
    )
    assert_clean_failure(run_cli("serve-edge", "--edge", edge, "--default-temperature", "7"), "between 0 and 2")
    assert_clean_failure(run_cli("chat", "--edge", edge, "--temperature", "-1"), "temperature")


def test_pipeline_flag_on_generate_chat_and_serve_edge():
    from splitlm.cli import build_parser, spec_arg

    parser = build_parser()
    for argv in (["generate", "--edge", "e", "--prompt", "p"], ["chat", "--edge", "e"], ["serve-edge", "--edge", "e"]):
        assert not spec_arg(parser.parse_args(argv)).pipeline
        spec = spec_arg(parser.parse_args([*argv, "--pipeline", "--spec", "ngram"]))
        assert spec.pipeline and spec.mode == "ngram"
