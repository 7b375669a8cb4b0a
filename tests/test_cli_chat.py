"""`splitlm chat` in a pseudo-terminal: a two-turn conversation that keeps its history."""

import re
import sys

import pytest

from splitlm.edge import Edge, EdgeConfig

pexpect = pytest.importorskip("pexpect")
pytestmark = pytest.mark.slow

STATS = re.compile(
    r"\r\n\[(\d+) tokens in (\d+) round trips · ([\d.]+) tokens/round trip · ([\d.]+) tok/s · "
    r"TTFT \d+ ms · up [\d.]+ KiB, down [\d.]+ KiB · context (\d+) tokens · (\w+)\]\r\n"
)


def ask(child, line):
    child.expect_exact("you> ")
    child.sendline(line)
    child.expect_exact("bot> ")
    child.expect(STATS)
    answer = child.before.replace("\r\n", "\n")
    tokens, round_trips, _, _, context, mode = child.match.groups()
    return answer, int(tokens), int(round_trips), int(context), mode


def test_two_turn_chat(bundled_split, bundled_server):
    n = 10
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "splitlm",
            "chat",
            "--edge",
            str(bundled_split / "edge"),
            "--cloud",
            bundled_server.url,
            "--max-new-tokens",
            str(n),
            "--wire-dtype",
            "fp32",
            "--spec",
            "ngram",
            "--threads",
            "1",
        ],
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 200),
    )
    try:
        first, t1, rt1, c1, mode = ask(child, "What is the capital of France?")
        second, t2, rt2, c2, _ = ask(child, "And of Italy?")
        child.expect_exact("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert mode == "ngram" and 1 <= t1 <= n and 1 <= t2 <= n and rt1 <= t1 and rt2 <= t2
    # the same conversation through the Python API: the second turn saw the first (history re-sent)
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        ids1 = edge.text.encode_messages(turn1)
        expected1 = edge.generate(ids1, n, spec="ngram")
        turn2 = turn1 + [{"role": "assistant", "content": expected1.text}, {"role": "user", "content": "And of Italy?"}]
        ids2 = edge.text.encode_messages(turn2)
        expected2 = edge.generate(ids2, n, spec="ngram")
    assert first == expected1.text and c1 == len(ids1) + t1
    assert second == expected2.text and c2 == len(ids2) + t2
    assert len(ids2) > len(ids1) + t1
