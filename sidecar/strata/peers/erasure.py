"""Reed-Solomon over GF(2^8) for the peer tier, on zfec (imported lazily).

Library choice (evaluated before writing any GF arithmetic of our own; measured on this
project's 2-core CI machine, RS(6, 2), 4 MiB blocks, one core, bench/peers.py):

- ``zfec`` 1.6 (Tahoe-LAFS; C, manylinux wheel, no dependencies): encode ~580 MB/s of input,
  decode ~640 MB/s. Raw blocks in, raw blocks out: a node's chunk is a block as it lies in RAM.
- ``pyeclib`` 1.8 (OpenStack Swift; wheel bundles liberasurecode and ISA-L): ``isa_l_rs_vand``
  encode ~450 MB/s (it splits one payload itself and prefixes every fragment with an 80-byte
  header), decode ~2 GB/s. Its fragment format would have to be synthesised around data that
  already lies in other nodes' RAM.
- ``galois`` (NumPy + numba): general GF arithmetic, a heavy JIT dependency for one matrix code.

zfec is systematic: blocks ``0..k-1`` are the data chunks themselves, ``k..k+m-1`` the parity.

Errors: :class:`ErasureUnavailable` (zfec not installed: ``pip install 'strata-checkpoint[peers]'``),
``ValueError`` on bad block counts or lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from strata.errors import StrataError


class ErasureUnavailable(StrataError, RuntimeError):
    """zfec is not installed; the message says how to install it."""


def _zfec() -> Any:
    try:
        import zfec
    except ImportError:
        raise ErasureUnavailable(
            "erasure coding needs the zfec package: pip install 'strata-checkpoint[peers]' (or zfec), or set "
            "peers.mode: replicate"
        ) from None
    return zfec


@functools.lru_cache(maxsize=64)
def _encoder(k: int, n: int) -> Any:
    return _zfec().Encoder(k, n)


@functools.lru_cache(maxsize=64)
def _decoder(k: int, n: int) -> Any:
    return _zfec().Decoder(k, n)


def _check(k: int, m: int) -> None:
    if not (k >= 1 and m >= 1 and k + m <= 256):
        raise ValueError(f"RS({k}, {m}): need k >= 1, m >= 1, k + m <= 256")


def encode_parity(
    blocks: Sequence[bytes | bytearray | memoryview], m: int, which: Sequence[int]
) -> list[bytes]:
    """Parity blocks ``which`` (0-based parity indices, each < ``m``) of the data ``blocks``.

    ``blocks``: the ``k`` data chunks, all the same length (pad the short ones with zeros).
    Returns one ``bytes`` per index in ``which``, each as long as a data block.
    """
    k = len(blocks)
    _check(k, m)
    if any(not 0 <= i < m for i in which):
        raise ValueError(f"parity indices {list(which)} out of range for m = {m}")
    lengths = {len(memoryview(b)) for b in blocks}
    if len(lengths) != 1:
        raise ValueError(f"data blocks differ in length: {sorted(lengths)}")
    inblocks = tuple(bytes(b) if isinstance(b, memoryview) else b for b in blocks)
    return [bytes(p) for p in _encoder(k, k + m).encode(inblocks, tuple(k + i for i in which))]


def decode(available: Mapping[int, bytes], k: int, m: int) -> list[bytes]:
    """The ``k`` data blocks from any ``k`` of the ``k + m`` blocks.

    ``available``: block number (data ``0..k-1``, parity ``k..k+m-1``) -> block; at least ``k``
    entries, all the same length. Raises ``ValueError`` with fewer than ``k``.
    """
    _check(k, m)
    if len(available) < k:
        raise ValueError(f"RS({k}, {m}) needs {k} blocks to decode, only {len(available)} given")
    nums = sorted(available)[:k]
    if any(not 0 <= n < k + m for n in nums):
        raise ValueError(f"block numbers {nums} out of range for RS({k}, {m})")
    if all(n < k for n in nums):
        return [available[n] for n in nums]
    out = _decoder(k, k + m).decode([available[n] for n in nums], nums)
    return [bytes(b) for b in out]
