"""The batching scheduler: sessions that share passes get exactly what they get alone."""

import threading

import pytest
import torch

from splitlm.cloud.runner import Job, Outputs, PassPlan, Piece, Step, begin_step, finish_step, run_layers
from splitlm.cloud.scheduler import BatchConfig, Scheduler
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits, Session, SessionTable
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.model.shards import CloudModel, load_cloud
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.messages import Control, Forward
from splitlm.transport.policy import CachePolicy

PROMPTS = [
    [5, 6, 7],
    [9, 3, 8, 1],
    [12, 40],
    [7, 7, 7, 7, 7],
    [100, 3, 100, 3, 100],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [250, 17],
    [(11 * i) % 200 + 3 for i in range(37)],
]  # mixed lengths (the last one is chunked)
# no window:N here: under a window the cloud's context depends on how tokens were grouped into steps,
# so its output follows the drafts, and `auto`'s drafts learn from the edge's earlier answers
POLICIES = ["session", "none", "sealed", "session"]


CUDA = pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device, padded",
    [("cpu", None), ("cpu", True), pytest.param("cuda", None, marks=CUDA)],
    ids=["per-session-attention", "padded-attention", "cuda"],
)
def test_eight_sessions_in_shared_passes_equal_each_alone(tiny_split, device, padded):
    """8 concurrent greedy sessions, `auto` speculation (one of them pipelined), mixed prompt lengths and
    cache policies, against one batching cloud: every output equals the session's output alone; also
    with one padded attention call per pass (a GPU's default, `splitlm.model.padded`), and with the
    cloud on a GPU (fp32; `benchmarks/gpu.sh` runs it)."""
    batch = BatchConfig(max_batch=8, prefill_chunk=16)
    with BackgroundServer(tiny_split / "cloud", batch=batch, device=device, dtype="fp32") as server:
        server.server.model.middle.pad_attention = padded
        edges = [
            Edge(
                tiny_split / "edge",
                server.url,
                EdgeConfig(wire_dtype="fp32", cache_policy=p, device="cpu", dtype="fp32"),
            )
            for p in POLICIES
        ]
        try:

            def run(i):
                spec = SpecConfig("auto", pipeline=i == 5)
                return edges[i % 4].generate(PROMPTS[i], max_new_tokens=20, stop_at_eos=False, spec=spec).token_ids

            solo = [run(i) for i in range(8)]  # one at a time: every pass holds one request
            registry = server.server.metrics.registry
            assert (
                registry.get_sample_value("splitlm_cloud_batch_size_sum")
                == registry.get_sample_value("splitlm_cloud_batch_size_count")
                > 0
            )
            results, errors = [None] * 8, []
            barrier = threading.Barrier(8)

            def thread(i):
                barrier.wait()
                try:
                    for _ in range(2):
                        results[i] = run(i)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=thread, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            for e in edges:
                e.close()
        assert not errors
        assert results == solo
        assert registry.get_sample_value("splitlm_cloud_batch_size_sum") > registry.get_sample_value(
            "splitlm_cloud_batch_size_count"
        ), "no pass held more than one session"
        assert server.server.sessions.sessions == {}


@torch.inference_mode()
def compute_batch(model: CloudModel, jobs: list[tuple[Session, Forward]]) -> list[Outputs | Exception]:
    """Several sessions' requests (at most one per session), whole, in one pass of the layers.
    Each entry of the answer is that request's reply tensors, or the error that failed it alone."""
    answers: list[Outputs | Exception | None] = [None] * len(jobs)
    steps: list[tuple[int, Step]] = []
    for i, (session, req) in enumerate(jobs):
        try:
            steps.append((i, begin_step(model, session, req)))
        except Exception as e:  # noqa: BLE001 - e.g. SEALED_KEY: this request fails, the others run
            answers[i] = e
    if steps:
        run_layers(model, [(step, step.rows) for _, step in steps])
        for i, step in steps:
            try:
                answers[i] = finish_step(model, step)
            except Exception as e:  # noqa: BLE001
                answers[i] = e
    return answers


def compute(model: CloudModel, session: Session, req: Forward) -> Outputs:
    """One request alone on the model's device; the reply's tensors in host memory."""
    (answer,) = compute_batch(model, [(session, req)])
    if isinstance(answer, Exception):
        raise answer
    return answer


@pytest.fixture(scope="module")
def cloud(tiny_split):
    return load_cloud(tiny_split / "cloud")


def requests(d: int, seed: int):
    """A prefill with context rows, then a tree step with keep: the request kinds a session sends."""
    g = torch.Generator().manual_seed(seed)
    n = 3 + seed % 5
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    return [
        Forward(torch.randn(n, d, generator=g), torch.arange(n), context=seed % 2),
        Forward(torch.randn(3, d, generator=g), torch.tensor([n, n + 1, n + 1]), tree),
        Forward(torch.randn(1, d, generator=g), torch.tensor([n + 2]), keep=[0, 2]),
    ]


def test_a_packed_pass_equals_each_request_alone(cloud):
    d, table = cloud.cfg.hidden_size, SessionTable(ServerLimits())
    layers = len(cloud.middle.layers)
    alone = [table.open(b"a", "fp32", layers) for _ in range(6)]
    packed = [table.open(b"b", "fp32", layers) for _ in range(6)]
    for step in range(3):
        want = [compute(cloud, s, requests(d, i)[step]) for i, s in enumerate(alone)]
        got = compute_batch(cloud, [(s, requests(d, i)[step]) for i, s in enumerate(packed)])
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-5, atol=1e-5)
            assert torch.equal(g.hidden.argmax(-1), w.hidden.argmax(-1))
    assert [s.cache.length for s in packed] == [s.cache.length for s in alone]


def test_a_failing_request_fails_alone(cloud):
    d, table = cloud.cfg.hidden_size, SessionTable(ServerLimits())
    layers = len(cloud.middle.layers)
    sealed = table.open(b"a", "fp32", layers, policy=CachePolicy("sealed"))
    other = table.open(b"a", "fp32", layers)
    key = b"k" * 32
    compute(cloud, sealed, Forward(torch.randn(2, d), torch.arange(2), control=Control(key=key)))
    bad = Forward(torch.randn(1, d), torch.tensor([2]), control=Control(key=b"x" * 32))
    answers = compute_batch(cloud, [(sealed, bad), (other, Forward(torch.randn(2, d), torch.arange(2)))])
    assert isinstance(answers[0], ProtocolError) and answers[0].code == ErrorCode.SEALED_KEY
    assert answers[1].hidden.shape == (2, d) and other.cache.length == 2
    assert sealed.cache_shape == (2, 0)  # unchanged


def job(sid: int, rows: int, d: int = 4, tree: bool = False) -> Job:
    session = type("S", (), {"id": sid, "closed": False})()
    mask = torch.ones(rows, rows, dtype=torch.bool).tril() if tree else None
    return Job(session, Forward(torch.zeros(rows, d), torch.arange(rows), mask))


def plan(*pieces: tuple[Job, int]) -> PassPlan:
    return PassPlan([Piece(j, n) for j, n in pieces])


def test_take_is_fifo_within_the_limits(cloud):
    sched = Scheduler(cloud, BatchConfig(max_batch=3, max_batch_tokens=10, prefill_chunk=100))
    try:
        jobs = [job(1, 2), job(1, 1), job(2, 9, tree=True), job(3, 4), job(4, 1), job(5, 1)]
        sched._queue.extend(jobs)
        with sched._cv:
            first = sched.take()  # 1's second request waits for its first; the 9-row tree does not fit beside 1
        assert first == plan((jobs[0], 2), (jobs[3], 4), (jobs[4], 1))
        for j in (jobs[0], jobs[3], jobs[4]):
            sched._queue.remove(j)
        with sched._cv:
            assert sched.take() == plan((jobs[1], 1), (jobs[2], 9))  # 10 rows
        sched._queue.remove(jobs[1])
        sched._queue.remove(jobs[2])
        big = job(6, 50, tree=True)
        sched._queue.append(big)
        with sched._cv:
            assert sched.take() == plan((jobs[5], 1))  # the big tree does not fit beside it
        sched._queue.remove(jobs[5])
        with sched._cv:
            assert sched.take() == plan((big, 50))  # a tree over the row limit runs alone
    finally:
        sched.close()


def test_a_long_causal_request_is_chunked_and_shares_passes(cloud):
    sched = Scheduler(cloud, BatchConfig(max_batch=8, max_batch_tokens=64, prefill_chunk=24))
    try:
        prefill, decode = job(1, 40), job(2, 1)
        closed = job(3, 1)
        closed.session.closed = True
        sched._queue.extend([prefill, decode, closed])
        with sched._cv:  # decode first; the prompt (the oldest request) gets its chunk
            assert sched.take() == plan((decode, 1), (prefill, 24))
        assert closed.future.exception().code == ErrorCode.UNKNOWN_SESSION  # dropped, never computed
        cancelled = job(5, 1)
        cancelled.future.cancel()  # its waiter went away (shutdown): dropped too
        sched._queue.append(cancelled)
        sched._queue.append(job(4, 60))  # another long causal request: it shares the prompt rows
        with sched._cv:
            after_a_chunk = sched.take()  # other steps wait: this pass runs them, no chunk
            pieces = sched.take()
        assert after_a_chunk == plan((decode, 1))
        assert [(p.job.session.id, p.rows) for p in pieces] == [(2, 1), (1, 24)]  # 24 prompt rows in all: none left
        assert cancelled not in sched._queue and closed not in sched._queue
    finally:
        sched.close()


def test_decode_steps_get_the_row_budget_first_and_the_oldest_prompt_always_progresses(cloud):
    sched = Scheduler(cloud, BatchConfig(max_batch=8, max_batch_tokens=40, prefill_chunk=32))
    try:
        old_prompt, young_prompt = job(1, 100), job(2, 100)
        steps = [job(10 + i, 9, tree=True) for i in range(4)]  # 36 rows of trees
        sched._queue.extend([steps[0], old_prompt, *steps[1:], young_prompt])
        with sched._cv:  # the steps take 36 of 40 rows; the prompts share the 4 left
            assert sched.take() == plan(*[(s, 9) for s in steps], (old_prompt, 4))
        with sched._cv:
            sched._ran_prompt = False
            sched._queue.remove(steps[0])  # done: the prompt is now the oldest request
            # the oldest request is a prompt: its chunk runs whatever the steps take
            assert sched.take() == plan(*[(s, 9) for s in steps[1:]], (old_prompt, 32))
    finally:
        sched.close()


def test_chunked_prefill_equals_one_pass(cloud):
    d, table = cloud.cfg.hidden_size, SessionTable(ServerLimits())
    layers = len(cloud.middle.layers)
    whole, chunked = (table.open(b"a", "fp32", layers) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    reqs = [
        Forward(torch.randn(50, d, generator=g), torch.arange(50), context=7),
        Forward(torch.randn(1, d, generator=g), torch.tensor([50])),
    ]
    timings = []
    sched = Scheduler(cloud, BatchConfig(prefill_chunk=8), on_pass=timings.append)
    try:
        for req in reqs:
            want = compute(cloud, whole, req)
            done = sched.submit(chunked, req).result(30)
            torch.testing.assert_close(done.outputs.hidden, want.hidden, rtol=1e-5, atol=1e-5)
            assert chunked.cache_shape == whole.cache_shape
        assert sched.passes == 7 + 1  # 50 rows in chunks of 8, then the decode step
        assert [t.rows for t in timings] == [8] * 6 + [2, 1] and {t.sessions for t in timings} == {1}
        assert all(t.begin_s >= 0 and t.layers_s > 0 and t.finish_s >= 0 for t in timings)
        assert all(t.seconds == t.begin_s + t.layers_s + t.finish_s for t in timings)
    finally:
        sched.close()


def test_the_row_budget_of_a_pass_follows_the_device_unless_given():
    from splitlm.cloud.scheduler import ACCELERATOR_PASS_TOKENS, CPU_PASS_TOKENS

    assert BatchConfig().for_device(torch.device("cpu")).max_batch_tokens == CPU_PASS_TOKENS == 64
    assert BatchConfig().for_device(torch.device("meta")).max_batch_tokens == ACCELERATOR_PASS_TOKENS
    assert BatchConfig(max_batch_tokens=300).for_device(torch.device("cpu")).max_batch_tokens == 300
    with pytest.raises(ValueError):
        BatchConfig(max_batch_tokens=-1)
