"""Sealed KV caches: a session's cache encrypted at rest under a key only the edge holds.

AES-256-GCM (`cryptography`); the nonce is the session's seal counter (it only grows, so a nonce
never repeats under a key), and the associated data binds the blob to its session and counter.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from splitlm.model.device import to_device
from splitlm.model.kv_cache import KVCache
from splitlm.model.paged_kv import PagedKVCache
from splitlm.transport.errors import ErrorCode, ProtocolError

KEY_BYTES = 32


def _aad(session_id: int, counter: int) -> bytes:
    return b"splitlm-sealed-cache" + struct.pack("!QQ", session_id, counter)


def _nonce(counter: int) -> bytes:
    return struct.pack("!IQ", 0, counter)


def check_key(key) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ProtocolError(ErrorCode.SEALED_KEY, f"a sealed session's request needs its {KEY_BYTES}-byte cache key")
    return key


def serialize(cache: KVCache | PagedKVCache) -> bytes:
    """The cache's entries in use as bytes: a msgpack header (shapes, dtype, positions), then raw k and v."""
    views = [cache.view(i) or (None, None) for i in range(cache.num_layers)]
    tensors = [t for pair in views for t in pair]
    present = [k is not None for k, _ in views]
    ref = next((t for t in tensors if t is not None), None)
    dtype = str(ref.dtype).removeprefix("torch.") if ref is not None else "float32"
    header = {
        "length": cache.length,
        "pending_start": cache.pending_start,
        "present": present,
        "dtype": dtype,
        "shapes": [list(t.shape) if t is not None else None for t in tensors],
        "positions": cache.positions.tolist(),
    }
    head = msgpack.packb(header)
    raw = b"".join(t.contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in tensors if t is not None)
    return struct.pack("!I", len(head)) + head + raw


def deserialize(
    data: bytes, into: KVCache | PagedKVCache | int, device: str | torch.device = "cpu"
) -> KVCache | PagedKVCache:
    """The serialized entries in `into`, an empty cache (or a layer count: a fresh `KVCache`), on `device`."""
    (n,) = struct.unpack_from("!I", data)
    header = msgpack.unpackb(data[4 : 4 + n])
    dtype = getattr(torch, header["dtype"])
    buf = np.frombuffer(data, dtype=np.uint8, offset=4 + n)
    offset, tensors = 0, []
    for shape in header["shapes"]:
        if shape is None:
            tensors.append(None)
            continue
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        chunk = torch.from_numpy(buf[offset : offset + nbytes].copy()).view(dtype).reshape(shape)
        tensors.append(chunk)
        offset += nbytes
    cache = KVCache(into) if isinstance(into, int) else into
    device = torch.device(device)
    cache.begin(header["length"], torch.tensor(header["positions"], dtype=torch.long, device=device))
    for i, (k, v) in enumerate(zip(tensors[0::2], tensors[1::2], strict=True)):
        if k is not None:
            cache.update(i, to_device(k, device), to_device(v, device))
    cache.pending_start = header["pending_start"]
    return cache


def seal(cache: KVCache | PagedKVCache, key: bytes, session_id: int, counter: int) -> bytes:
    return AESGCM(key).encrypt(_nonce(counter), serialize(cache), _aad(session_id, counter))


def unseal(
    blob: bytes,
    key: bytes,
    session_id: int,
    counter: int,
    into: KVCache | PagedKVCache | int,
    device: str | torch.device = "cpu",
) -> KVCache | PagedKVCache:
    try:
        data = AESGCM(key).decrypt(_nonce(counter), blob, _aad(session_id, counter))
    except InvalidTag:
        raise ProtocolError(ErrorCode.SEALED_KEY, "the sealed cache does not open with this key") from None
    return deserialize(data, into, device)
