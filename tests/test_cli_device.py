"""--device and --dtype on every command that runs model layers: accepted, honoured on the CPU,
and a clear error for a device this machine does not have."""

import json

import pytest
import torch

from splitlm import SplitLMError
from splitlm.cli import build_parser, edge_config, main
from splitlm.cloud.local import cloud_process, health

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("command", ["generate", "chat", "serve-edge"])
def test_edge_commands_take_device_and_dtype(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    args = build_parser().parse_args([command, "--edge", "e", *extra, "--device", "cpu", "--dtype", "bf16"])
    config = edge_config(args)
    assert (config.device, config.dtype) == ("cpu", "bf16")
    defaults = edge_config(build_parser().parse_args([command, "--edge", "e", *extra]))
    assert (defaults.device, defaults.dtype) == ("auto", "auto")


@pytest.mark.parametrize("command", ["generate", "serve-cloud", "bench", "demo"])
def test_a_dtype_outside_the_choices_is_refused(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--dtype", "fp64"])
    assert e.value.code == 2 and "invalid choice: 'fp64'" in capsys.readouterr().err


def test_bench_and_demo_take_both_sides(monkeypatch):
    from splitlm.cli.bench import config_from_args

    args = build_parser().parse_args(
        ["bench", "--device", "cpu", "--dtype", "fp32", "--cloud-device", "cpu", "--cloud-dtype", "bf16"]
    )
    config = config_from_args(args)
    assert (config.device, config.dtype, config.cloud_device, config.cloud_dtype) == ("cpu", "fp32", "cpu", "bf16")
    seen = []
    monkeypatch.setattr("splitlm.cli.demo.run_demo", lambda config: seen.append(config) or 0)
    assert main(["demo", "--device", "cpu", "--dtype", "fp16"]) == 0
    assert (seen[-1].device, seen[-1].dtype, seen[-1].cloud_device, seen[-1].cloud_dtype) == (
        "cpu",
        "fp16",
        "cpu",
        "fp16",
    )
    assert main(["demo", "--cloud-dtype", "bf16"]) == 0
    assert (seen[-1].dtype, seen[-1].cloud_device, seen[-1].cloud_dtype) == ("auto", "auto", "bf16")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_serve_cloud_runs_in_the_dtype_asked_for(tiny_split, dtype):
    with cloud_process(tiny_split / "cloud", "cpu", dtype) as port:
        h = health(port)
    assert (h["status"], h["device"], h["dtype"]) == ("ok", "cpu", dtype)


def test_serve_cloud_auto_is_the_cpu_in_fp32_here(tiny_split):
    if not NO_CUDA:
        pytest.skip("this machine has CUDA")
    with cloud_process(tiny_split / "cloud") as port:
        assert (health(port)["device"], health(port)["dtype"]) == ("cpu", "fp32")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_serve_cloud_on_a_missing_device_fails_clearly(tiny_split):
    with pytest.raises(SplitLMError, match="exited during start-up: splitlm: error: --device cuda: no CUDA device"):
        with cloud_process(tiny_split / "cloud", "cuda", "auto"):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_generate_runs_the_edge_in_the_dtype_asked_for(bundled_split, bundled_server, capsys, dtype):
    assert (
        main(
            [
                "generate",
                "--edge",
                str(bundled_split / "edge"),
                "--cloud",
                bundled_server.url,
                "--prompt",
                "The capital of France is",
                "--max-new-tokens",
                "6",
                "--json",
                "--device",
                "cpu",
                "--dtype",
                dtype,
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["edge"] == {"device": "cpu", "dtype": dtype}
    assert out["stats"]["new_tokens"] >= 1 and out["text"].strip()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_generate_on_a_missing_device_fails_clearly(tiny_split, tiny_server, capsys):
    assert (
        main(
            [
                "generate",
                "--edge",
                str(tiny_split / "edge"),
                "--cloud",
                tiny_server.url,
                "--prompt",
                "x",
                "--device",
                "cuda:1",
            ]
        )
        == 1
    )
    assert "--device cuda:1: no CUDA device is available" in capsys.readouterr().err
