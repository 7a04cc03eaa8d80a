"""Elements of ``mx.random.gumbel((V,), key)`` at chosen columns only, bit for bit, on the CPU.

Why: after nucleus filtering a sampler's ``argmax(x + T * g)`` only looks at the kept tokens (a
few dozen of a 49k-token row), yet drawing the whole noise row costs as much as the filter.

How MLX draws it (mlx/random.cpp and the CPU ``RandomBits`` kernel, mlx 0.32): ``gumbel`` is
``-log(-log(uniform))`` and ``uniform`` is ``min(bits / float32(2^32 - 1), nextafter(1, 0))``
(times the range 1, plus 0) of ``random.bits``, whose V uint32 words per key come from the
Threefry-2x32 hash (Salmon et al. 2011, 20 rounds, as in JAX) of a counter pair: with
``h = V // 2`` and ``o = V % 2``, the pair ``(j, j + h + o)`` gives word ``j`` (first half of the
hash) and word ``j + h + o`` (second half) for ``j < h``, and for odd V word ``h`` is the first
half of the hash of ``(h, 0)``. :func:`threefry_bits` reproduces those words at any columns with
NumPy; the float steps then run as MLX ops on the chosen elements (MLX's CPU elementwise ops
treat every element alike, so an element's value does not depend on which array it is in).
:func:`exact_here` checks the whole chain against ``mx.random.gumbel`` once per process, so a
future MLX that draws differently falls back to the full row instead of changing samples.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0: np.ndarray, k1: np.ndarray, c0: np.ndarray, c1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Threefry-2x32 hash (20 rounds) of counters ``(c0, c1)`` under keys ``(k0, k1)``, all
    uint32 arrays of one shape (wrapping arithmetic)."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def threefry_bits(keys: np.ndarray, cols: np.ndarray, vocab_size: int) -> np.ndarray:
    """Word ``cols[n]`` of ``mx.random.bits((vocab_size,), key=keys[n])`` for each n: ``keys``
    (N, 2) uint32, ``cols`` (N,) ints in [0, vocab_size)."""
    h, o = vocab_size // 2, vocab_size % 2
    cols = cols.astype(np.int64)
    first = cols < h
    second = cols >= h + o  # for odd V the middle word is neither: the hash of (h, 0), first half
    c0 = np.where(first, cols, np.where(second, cols - h - o, h)).astype(np.uint32)
    c1 = np.where(first, cols + h + o, np.where(second, cols, 0)).astype(np.uint32)
    with np.errstate(over="ignore"):
        x0, x1 = threefry2x32(keys[:, 0].astype(np.uint32), keys[:, 1].astype(np.uint32), c0, c1)
    return np.where(second, x1, x0)


def gumbel_from_bits(bits: mx.array) -> mx.array:
    """``mx.random.gumbel``'s float steps on uint32 words (see the module docstring), float32."""
    u = mx.divide(bits, mx.array(np.iinfo(np.uint32).max, dtype=mx.float32))
    u = mx.minimum(u, mx.array(np.nextafter(np.float32(1), np.float32(0)), dtype=mx.float32))
    u = mx.add(mx.multiply(mx.array(1.0, dtype=mx.float32), u), mx.array(0.0, dtype=mx.float32))
    return mx.negative(mx.log(mx.negative(mx.log(u))))


def gumbel_at(keys: np.ndarray, cols: np.ndarray, vocab_size: int) -> mx.array:
    """Element ``cols[n]`` of ``mx.random.gumbel((vocab_size,), key=keys[n])`` for each n."""
    return gumbel_from_bits(mx.array(threefry_bits(keys, cols, vocab_size)))


_EXACT: dict[str, bool] = {}


def shifted_columns(v: int) -> list[np.ndarray]:
    """Column subsets whose elements sit at other positions than in the full row: every third
    column from 1 (an odd count, so a vector kernel's scalar tail lands elsewhere) and all columns
    reversed. A value that depended on its lane or position would differ there."""
    every_third = np.arange(1, v, 3)
    if len(every_third) % 2 == 0:
        every_third = every_third[:-1]
    return [every_third, np.arange(v)[::-1].copy()]


def exact_here() -> bool:
    """Whether :func:`gumbel_at` equals ``mx.random.gumbel`` on this MLX and device (checked once:
    two keys, an odd and an even row length, every column, and subsets of columns gathered at
    shifted positions: :func:`shifted_columns`)."""
    device = str(mx.default_device())
    if device not in _EXACT:
        ok = True
        for seed, v in ((7, 1001), (2**40 + 3, 1000)):
            key = mx.random.key(seed)
            want = np.array(mx.random.gumbel((v,), key=key)).view(np.uint32)
            for cols in [np.arange(v)] + shifted_columns(v):
                keys = np.broadcast_to(np.array(key, dtype=np.uint32), (len(cols), 2))
                got = np.array(gumbel_at(keys, cols, v)).view(np.uint32)
                ok = ok and np.array_equal(got, want[cols])
        _EXACT[device] = ok
    return _EXACT[device]
