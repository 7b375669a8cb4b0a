"""Giving the host memory that the cloud freed back to the system.

glibc's allocator keeps memory that Python and torch free in its arenas (one per thread that
allocates: the event loop, the compute thread, the codec pool) and returns it to the system only
when the top of an arena is free. A cloud whose sessions come and go allocates tensors of ever
changing shapes, so its resident size creeps up with nothing counted growing (the 20-minute soak of
12-03: +6.4 %). `malloc_trim(0)` returns the free pages of every arena; the cloud calls it every
`ServerLimits.malloc_trim_s` seconds (`serve-cloud --malloc-trim-s`, 0 = never). Only glibc has it
(elsewhere this does nothing); it is the C library's own call, through `ctypes`: no package wraps it.
Measured since the paged KV cache (docs/results.md, the 60-minute soaks of 12-06): with or without
the trim the RSS stays within 2.5 % of its warm-up level, so the trim is a cheap guard, not the fix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_available() -> bool:
    return _libc() is not None


def malloc_trim() -> bool:
    """Return the allocator's free memory to the system (True: some was returned)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
