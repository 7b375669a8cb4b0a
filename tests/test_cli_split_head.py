"""CLI for the split-head topology and vocabulary subsets: the happy path and clean failures."""

import json

import pytest

from splitlm.cli import main
from test_cli import assert_clean_failure, run_cli


def test_split_head_split_and_generate(tiny_llama, tmp_path, capsys):
    from splitlm.cloud.server import BackgroundServer

    assert (
        main(
            [
                "split",
                "--model",
                str(tiny_llama),
                "--topology",
                "split-head",
                "--d-end",
                "16",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "s" / "edge" / "manifest.json").read_text())
    assert (manifest["topology"], manifest["tail"], manifest["d_end"]) == ("split-head", 0, 16)
    allow = tmp_path / "allow.txt"
    allow.write_text("7 8 9")
    capsys.readouterr()
    with BackgroundServer(tmp_path / "s" / "cloud") as server:
        assert (
            main(
                [
                    "generate",
                    "--edge",
                    str(tmp_path / "s" / "edge"),
                    "--cloud",
                    server.url,
                    "--prompt",
                    "x",
                    "--vocab",
                    str(allow),
                    "--max-new-tokens",
                    "5",
                    "--ignore-eos",
                    "--json",
                    "--spec",
                    "none",
                ]
            )
            == 1
        )
        assert "has no tokenizer" in capsys.readouterr().err  # text prompts need the tokenizer the tiny model lacks


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "split-head", "--tail", "2"], "no tail layers"),
        (["--topology", "split-head", "--d-end", "64"], "d-end must be an integer in [1, 64)"),
        (["--d-end", "8"], "only applies to --topology split-head"),
        (["--topology", "head-split"], "invalid choice"),
    ],
)
def test_split_errors(tiny_llama, tmp_path, args, message):
    assert_clean_failure(run_cli("split", "--model", str(tiny_llama), "--out", str(tmp_path / "o"), *args), message)


def test_generate_with_a_missing_allow_list(tiny_split):
    proc = run_cli(
        "generate",
        "--edge",
        str(tiny_split / "edge"),
        "--cloud",
        "ws://127.0.0.1:9",
        "--prompt",
        "hi",
        "--vocab",
        "/nonexistent/ids.txt",
    )
    assert_clean_failure(proc, "not all, en, zh or an allow-list file")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--edge", "e", "--topology", "split-head"], "come from it"),
        (["--topology", "split-head", "--tail", "2"], "no tail layers"),
        (["--d-end", "100"], "only applies to --topology split-head"),
        (["--vocab", "/nonexistent/ids.txt"], "not all, en, zh or an allow-list file"),
        (["--edge", "/nonexistent/edge", "--modes", "split-seq"], "no such directory"),
    ],
)
def test_bench_errors(capsys, argv, message):
    assert main(["bench", "--no-memory", "--no-plots", "--limit", "1", *argv]) == 1
    assert message in capsys.readouterr().err
