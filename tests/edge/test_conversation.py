"""Multi-turn chat that reuses the authorised cloud cache, and the cache policies on the bundled model."""

import json

import pytest

from conftest import hf_greedy
from splitlm.cli import main
from splitlm.edge import Edge, EdgeConfig

pytestmark = pytest.mark.slow

TURNS = ["Name one planet of the solar system.", "What colour is it?"]


def rendered(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("policy", ["session", "none", "sealed"])
def test_two_turns_reuse_the_cache_and_match_the_full_model(bundled_split, bundled_server, bundled_hf, policy):
    hf, tok = bundled_hf
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32", cache_policy=policy)) as edge:
        chat = edge.conversation(spec="auto")
        first = chat.say(TURNS[0], max_new_tokens=24)
        second = chat.say(TURNS[1], max_new_tokens=24)
        chat.close()
    messages = [{"role": "user", "content": TURNS[0]}]
    assert first.token_ids == hf_greedy(hf, rendered(tok, messages), 24)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TURNS[1]}]
    ids = rendered(tok, messages)
    assert second.prompt_ids == ids
    assert second.token_ids == hf_greedy(hf, ids, 24)  # reuse equals no reuse (the full model from scratch)
    assert second.stats.cached_tokens > len(rendered(tok, messages[:1]))  # the first turn was not re-fed


def test_generate_gives_the_same_tokens_under_every_cache_policy(bundled_split, bundled_server, capsys):
    outputs = {}
    for policy in ("session", "none", "sealed", "window:4096"):
        code = main(
            [
                "generate",
                "--edge",
                str(bundled_split / "edge"),
                "--cloud",
                bundled_server.url,
                "--prompt",
                "def add(a, b):",
                "--max-new-tokens",
                "24",
                "--json",
                "--wire-dtype",
                "fp32",
                "--cache-policy",
                policy,
            ]
        )
        assert code == 0
        outputs[policy] = json.loads(capsys.readouterr().out)["token_ids"]
    assert len({tuple(v) for v in outputs.values()}) == 1, outputs


def test_a_bad_cache_policy_is_a_clean_cli_error(bundled_split, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--edge", str(bundled_split / "edge"), "--prompt", "x", "--cache-policy", "window:0"])
    assert e.value.code == 2
    assert "window:N needs an integer N >= 1" in capsys.readouterr().err
