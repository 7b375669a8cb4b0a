"""What a newcomer runs into (issue 24): each bad input gives one `splitlm: error:` line and a
non-zero exit, never a traceback; prompts from stdin or a file; --chat by default where there is a
chat template; chat's commands and piped input; serve-edge's busy port, request log and /healthz."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import make_tiny_llama, save_byte_tokenizer
from splitlm.cloud.local import free_port
from splitlm.cloud.server import BackgroundServer
from splitlm.model.shards import split_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def run_cli(*args, stdin: str | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "splitlm", *args], capture_output=True, text=True, timeout=timeout, input=stdin
    )


def one_line_error(proc, needle: str, status: int | None = None) -> str:
    """The command failed with exactly one error line (containing `needle`) and no traceback."""
    assert proc.returncode != 0 and (status is None or proc.returncode == status), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    return errors[0]


@pytest.fixture(scope="module")
def text_split(tmp_path_factory):
    """A tiny random model with a byte-level tokenizer that has a chat template (context: 512 tokens)."""
    model = make_tiny_llama(tmp_path_factory.mktemp("text-model"), seed=5)
    save_byte_tokenizer(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return split_model(str(model), 2, 2, tmp_path_factory.mktemp("text-split"))


@pytest.fixture(scope="module")
def text_server(text_split):
    with BackgroundServer(text_split / "cloud") as server:
        yield server


def round_trips(server) -> float:
    return server.server.metrics.registry.get_sample_value("splitlm_cloud_round_trips_total")


def damaged_copy(split, tmp_path, role: str, damage) -> str:
    copy = tmp_path / "copy"
    shutil.copytree(split, copy)
    path = sorted((copy / role).glob("weights-*.safetensors"))[0]
    path.write_bytes(damage(path.read_bytes()))
    return str(copy / role)


# --- the listed cases --------------------------------------------------------------------------


def test_truncated_weights(text_split, text_server, tmp_path):
    edge = damaged_copy(text_split, tmp_path, "edge", lambda b: b[: len(b) // 2])
    one_line_error(
        run_cli("generate", "--edge", edge, "--cloud", text_server.url, "--prompt", "hi"), "checksum mismatch", 1
    )


def test_weights_changed_in_place_fail_their_checksum(text_split, tmp_path):
    cloud = damaged_copy(text_split, tmp_path, "cloud", lambda b: b[:-4] + b"\xff\xff\xff\x7f")
    one_line_error(run_cli("serve-cloud", "--shard", cloud, "--port", "0"), "checksum mismatch", 1)


def test_broken_manifest_names_the_file(text_split, text_server, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(text_split, copy)
    (copy / "edge" / "manifest.json").write_text('{"role": "edge", ')
    line = one_line_error(
        run_cli("generate", "--edge", str(copy / "edge"), "--cloud", text_server.url, "--prompt", "hi"),
        "manifest.json",
        1,
    )
    assert str(copy / "edge" / "manifest.json") in line


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_cloud_bad_port(text_split, port):
    one_line_error(run_cli("serve-cloud", "--shard", str(text_split / "cloud"), "--port", port), "--port", 2)


def test_a_prompt_too_long_is_refused_before_anything_is_sent(text_split, text_server):
    before = round_trips(text_server)
    line = one_line_error(
        run_cli(
            "generate",
            "--edge",
            str(text_split / "edge"),
            "--cloud",
            text_server.url,
            "--prompt",
            "x" * 600,
            "--no-chat",
        ),
        "context holds 512",
        1,
    )
    assert "600 tokens" in line
    assert round_trips(text_server) == before  # nothing reached the cloud's layers


def test_serve_edge_on_a_busy_port(text_split, text_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli(
            "serve-edge",
            "--edge",
            str(text_split / "edge"),
            "--cloud",
            text_server.url,
            "--port",
            str(port),
            "--spec",
            "none",
        )
    one_line_error(proc, f"cannot listen on 127.0.0.1:{port}", 1)
    assert "serving" not in proc.stderr


def test_missing_prompt_file(text_split, text_server, tmp_path):
    one_line_error(
        run_cli(
            "generate",
            "--edge",
            str(text_split / "edge"),
            "--cloud",
            text_server.url,
            "--prompt-file",
            str(tmp_path / "nope.txt"),
        ),
        "nope.txt",
        1,
    )


# --- no surprises ------------------------------------------------------------------------------


def generate_json(split, server, *args, stdin=None) -> dict:
    proc = run_cli(
        "generate",
        "--edge",
        str(split / "edge"),
        "--cloud",
        server.url,
        "--max-new-tokens",
        "4",
        "--json",
        "--spec",
        "none",
        "--wire-dtype",
        "fp32",
        *args,
        stdin=stdin,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_prompt_from_stdin_or_a_file_and_chat_by_default(text_split, text_server, tmp_path):
    plain = generate_json(text_split, text_server, "--prompt", "abc", "--no-chat")
    assert plain["prompt_tokens"] == 3  # one byte, one token
    chat = generate_json(text_split, text_server, "--prompt", "abc")  # the template: role markers around it
    assert chat["prompt_tokens"] == len("<|user|>abc\n<|assistant|>")
    same = {k: chat[k] for k in ("token_ids", "prompt_tokens")}
    piped = generate_json(text_split, text_server, "--prompt", "-", stdin="abc\n")
    assert {k: piped[k] for k in same} == same
    (tmp_path / "p.txt").write_text("abc\n")
    from_file = generate_json(text_split, text_server, "--prompt-file", str(tmp_path / "p.txt"))
    assert {k: from_file[k] for k in same} == same


def test_chat_commands_and_piped_input(text_split, text_server):
    proc = run_cli(
        "chat",
        "--edge",
        str(text_split / "edge"),
        "--cloud",
        text_server.url,
        "--max-new-tokens",
        "3",
        "--spec",
        "none",
        stdin="/foo\n/help\nhello\n/exit\n",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[unknown command /foo;" in out and "/revoke" in out.split("[unknown command")[1]
    assert "you> hello\nbot> " in out  # the piped line is echoed, the answer starts on its own line
    assert out.count("tokens in ") == 1  # only "hello" went to the model


def test_serve_edge_logs_requests_and_reports_the_cloud(text_split, tmp_path):
    port, log = free_port(), tmp_path / "stderr.txt"
    with BackgroundServer(text_split / "cloud") as server, open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitlm",
                "serve-edge",
                "--edge",
                str(text_split / "edge"),
                "--cloud",
                server.url,
                "--port",
                str(port),
                "--spec",
                "none",
                "--model-name",
                "tiny",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            health = None
            for _ in range(300):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                        health = json.loads(r.read())
                    break
                except OSError:
                    time.sleep(0.1)
            assert health is not None and health["status"] == "ok" and health["cloud"]["status"] == "ok"
            assert health["cloud"]["fingerprint"] == server.server.manifest.fingerprint
            body = json.dumps({"model": "tiny", "prompt": "secret words", "max_tokens": 2, "temperature": 0})
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as r:
                assert r.status == 200
            server.__exit__(None, None, None)  # the cloud goes away; the edge stays up
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
            assert e.value.code == 503
            down = json.loads(e.value.read())
            assert down["status"] == "degraded" and down["cloud"]["status"] == "unreachable"
        finally:
            proc.terminate()
            proc.wait(10)
    text = log.read_text()
    assert "POST /v1/completions 200" in text
    assert "secret" not in text  # no request text in the log


def test_every_flag_has_help_with_its_default():
    import argparse

    from splitlm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        formatter = p._get_formatter()
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action) if action.help else ""
            has_default = action.default not in (None, False, argparse.SUPPRESS) or action.default == 0
            if not action.help or (has_default and action.default is not False and "default" not in text):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing
    generate = sub.choices["generate"].format_help()
    assert "ws://127.0.0.1:8765" in generate and "(default: 128)" in generate
    assert os.environ.get("SPLITLM_QUIET") in (None, "")  # building the parser changes nothing


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["wan", "--upstream", "127.0.0.1:1", "--rtt-ms", "abc"], "--rtt-ms"),
        (["wan", "--upstream", "127.0.0.1:1", "--rtt-ms", "-1"], "--rtt-ms"),
        (["generate", "--edge", "e", "--prompt", "hi", "--failover-timeout", "0"], "--failover-timeout"),
        (["generate", "--edge", "e", "--prompt", "hi", "--ping-interval", "-1"], "--ping-interval"),
        (["serve-cloud", "--shard", "c", "--ping-interval", "inf"], "--ping-interval"),
        (["train-head", "--edge", "e", "--minutes", "-1"], "--minutes"),
        (["loadtest", "--seconds", "0"], "--seconds"),
        (["harden", "--lr", "nan", "--out", "o"], "--lr"),
        (["bench", "--jitter-ms", "-1"], "--jitter-ms"),
        (["bench", "--mbps", "0"], "--mbps"),
        (["serve-cloud", "--shard", "c", "--idle-timeout", "-5"], "--idle-timeout"),
        (["serve-edge", "--edge", "e", "--prefix-pool-ttl", "-1"], "--prefix-pool-ttl"),
        (["bench", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["bench", "--limit", "x"], "--limit"),
        (["bench", "--head", "0"], "--head"),
        (["bench", "--prefill", "--repeats", "0"], "--repeats"),
        (["loadtest", "--max-batch", "0"], "--max-batch"),
        (["loadtest", "--tail", "-1"], "--tail"),
    ],
)
def test_a_bad_number_is_refused_by_the_parser(argv, flag, capsys):
    """Out-of-range durations, rates and sizes stop at the parser with the flag named, before any work."""
    from splitlm.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: expected a" in err and "_" not in err.split(flag, 1)[1]
