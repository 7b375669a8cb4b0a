"""One Edge used from several threads: each request has its own cloud connection and session;
a connection the cloud dropped while idle is replaced; stop strings are cut and held back."""

import threading

from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.text import find_stop, held_back


def test_threads_get_their_own_connections_and_the_same_tokens(tiny_split, tiny_server):
    prompts = [[5, 6, 7], [9, 3, 8, 1], [12, 40], [7, 7, 7, 7, 7]]
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        solo = [edge.generate(p, max_new_tokens=24, stop_at_eos=False).token_ids for p in prompts]
        assert edge.connections.count == 1  # one at a time: the pooled connection is reused
        results = [None] * len(prompts)
        barrier = threading.Barrier(len(prompts))

        def run(i):
            barrier.wait()
            for _ in range(3):
                results[i] = edge.generate(prompts[i], max_new_tokens=24, stop_at_eos=False).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == solo
        assert 1 < edge.connections.count <= len(prompts)
        assert edge.connections.idle == edge.connections.count  # all returned to the pool
    assert tiny_server.server.sessions.sessions == {}


def test_a_stale_pooled_connection_is_replaced(tiny_split, tiny_server):
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        before = edge.generate([5, 6, 7], max_new_tokens=5, stop_at_eos=False).token_ids
        edge.client.ws.close()  # as the cloud does to a connection idle for its timeout
        assert edge.generate([5, 6, 7], max_new_tokens=5, stop_at_eos=False).token_ids == before
        assert edge.client not in edge.connections and edge.connections.count == 1


def test_stop_strings_are_found_and_their_beginnings_held_back():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello", ["xyz"]) is None
    assert held_back("the end is ne", ["near", "x"]) == 2  # "ne" may become "near"
    assert held_back("the end is n", ["near"]) == 1
    assert held_back("the end", ["near"]) == 0
    assert held_back("caf\ufffd", []) == 1  # an incomplete UTF-8 sequence
    assert held_back("abcab", ["abcabd"]) == 5


def test_a_prompt_longer_than_the_clouds_forward_limit_goes_in_chunks(tiny_split, tiny_server):
    from splitlm.cloud.server import BackgroundServer
    from splitlm.cloud.sessions import ServerLimits

    prompt = [(7 * i) % 200 + 3 for i in range(21)]
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        expected = edge.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(max_tokens_per_forward=8)) as small:
        with Edge(tiny_split / "edge", small.url, EdgeConfig(wire_dtype="fp32")) as edge:
            result = edge.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    assert result.token_ids == expected.token_ids
    s = result.stats
    assert s.prefill_round_trips == 3 and s.round_trips == 3 + 5 and s.tokens_per_round_trip == 1.0
