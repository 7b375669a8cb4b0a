"""The cloud gives freed host memory back to the system on a timer (`cloud.memory`)."""

import time

from splitlm.cloud.memory import malloc_trim, trim_available
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits


def test_malloc_trim_runs_on_its_timer_and_never_when_off(tiny_split):
    if not trim_available():  # not glibc: nothing to call
        assert malloc_trim() is False
        return
    big = [bytearray(64 * 1024) for _ in range(2000)]  # ~128 MB in small blocks, then freed
    del big
    assert isinstance(malloc_trim(), bool)
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(malloc_trim_s=0.05)) as server:
        deadline = time.monotonic() + 10
        while server.server.stats.malloc_trims < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert b"splitlm_cloud_malloc_trims_total" in server.server.scrape()
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(malloc_trim_s=0)) as server:
        time.sleep(0.2)
        assert server.server.stats.malloc_trims == 0
