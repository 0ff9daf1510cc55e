"""What a user would pick instead of Strata, and the physical floor, on the same bytes.

Floor: a memcpy of every tensor into a buffer that is already allocated, faulted in and mapped
(the best any RAM checkpoint can do), single-threaded and with all threads, both with
``ctypes.memmove`` (libc memcpy, GIL released) and with ``torch.Tensor.copy_``.
Alternatives: a fresh-file write to /dev/shm, ``torch.save``, ``safetensors.torch.save_file``,
``torch.distributed.checkpoint.save`` and ``async_save`` (blocking part and completion).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.harness import Measure

ALIGN = 64


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Offsets of ``tensors`` packed back to back at :data:`ALIGN`, and the total size."""
    offsets, pos = [], 0
    for t in tensors:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(pos)
        pos += t.numel() * t.element_size()
    return offsets, pos


class PrefaultedBuffer:
    """A tmpfs file, allocated (posix_fallocate) and mapped with MAP_POPULATE: no page faults.

    The same medium and the same preparation as a Strata RAM slot, so the memcpy into it is the
    floor a slot copy can reach.
    """

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = max(nbytes, 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
            self.mm = mmap.mmap(
                fd,
                self.nbytes,
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.addr = self.tensor.data_ptr()

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self.mm.close()
        self.path.unlink(missing_ok=True)


def _ranges(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], parts: int
) -> list[list[tuple[int, int, int]]]:
    """Split the copy (src address, dst offset, n) into ``parts`` lists of ~equal bytes."""
    pieces = [
        (t.data_ptr(), off, t.numel() * t.element_size())
        for t, off in zip(tensors, offsets, strict=True)
    ]
    total = sum(n for _, _, n in pieces)
    share = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    part, room = 0, share
    for src, dst, n in pieces:
        while n > 0:
            take = min(n, room)
            out[part].append((src, dst, take))
            src, dst, n, room = src + take, dst + take, n - take, room - take
            if room == 0 and part < parts - 1:
                part, room = part + 1, share
    return [p for p in out if p]


class MemcpyFloor:
    """memcpy of the workload's tensors into a pre-faulted tmpfs buffer (save) and back (restore)."""

    def __init__(self, tensors: Sequence[torch.Tensor], workdir: Path, threads: int) -> None:
        self.tensors = [t.contiguous() for t in tensors]
        self.offsets, total = layout(self.tensors)
        self.buf = PrefaultedBuffer(workdir / "memcpy-floor.buf", total)
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="memcpy")
        self.parts = {n: _ranges(self.tensors, self.offsets, n) for n in {1, threads}}
        self.views = [
            self.buf.tensor[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, o in zip(self.tensors, self.offsets, strict=True)
        ]

    def _run(self, threads: int, to_buffer: bool) -> None:
        base = self.buf.addr
        move = ctypes.memmove

        def work(part: list[tuple[int, int, int]]) -> None:
            for src, off, n in part:
                if to_buffer:
                    move(base + off, src, n)
                else:
                    move(src, base + off, n)

        parts = self.parts[threads]
        if threads == 1:
            work(parts[0])
        else:
            list(self.pool.map(work, parts))

    def memmove(self, threads: int) -> Measure:
        t0 = time.perf_counter()
        self._run(threads, to_buffer=True)
        return {"seconds": time.perf_counter() - t0}

    def memmove_back(self, threads: int) -> Measure:
        """Restore floor: copy from the buffer into the existing tensors."""
        t0 = time.perf_counter()
        self._run(threads, to_buffer=False)
        return {"seconds": time.perf_counter() - t0}

    def torch_copy(self, threads: int) -> Measure:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            for dst, src in zip(self.views, self.tensors, strict=True):
                dst.copy_(src)
            return {"seconds": time.perf_counter() - t0}
        finally:
            torch.set_num_threads(prev)

    def close(self) -> None:
        self.pool.shutdown()
        self.views.clear()
        self.buf.close()


def fresh_file_write(tensors: Sequence[torch.Tensor], path: Path) -> Measure:
    """Write every tensor's bytes into a new tmpfs file (each page faulted in on first touch)."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return {"seconds": time.perf_counter() - t0}


def torch_save(state: dict[str, Any], path: Path) -> Measure:
    t0 = time.perf_counter()
    torch.save(state, path)
    return {"seconds": time.perf_counter() - t0}


def safetensors_save(flat: dict[str, torch.Tensor], path: Path) -> Measure:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    save_file(flat, str(path))
    return {"seconds": time.perf_counter() - t0}


def dcp_save(state: dict[str, Any], directory: Path) -> Measure:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return {"seconds": time.perf_counter() - t0}


def dcp_async_save(state: dict[str, Any], directory: Path) -> Measure:
    """``seconds``: the blocking part; ``complete_s``: until the checkpoint is on disk.

    The blocking part lasts until the state is staged (copied): ``async_save`` returning, plus
    ``staging_completion`` when it returns an ``AsyncSaveResponse`` (asynchronous stagers),
    because the training loop may not modify the tensors before that.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fut: Any = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True
        )
        returned = time.perf_counter() - t0
        staging = getattr(fut, "staging_completion", None)
        if staging is not None:
            staging.result()
        blocking = time.perf_counter() - t0
        upload = getattr(fut, "upload_completion", fut)
        upload.result()
    return {"seconds": blocking, "returns_s": returned, "complete_s": time.perf_counter() - t0}


def torch_load(path: Path) -> Measure:
    """Restore with torch.load (mmap=False: every byte is read into fresh tensors)."""
    t0 = time.perf_counter()
    state = torch.load(path, weights_only=True)
    n = sum(t.numel() for t in _iter_tensors(state))
    del state
    return {"seconds": time.perf_counter() - t0, "elements": float(n)}


def _iter_tensors(node: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return out


# ---- promotion baselines: the same bytes copied to the PVC-like disk with fsync ---------------


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_file_cache(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (so a read really reads the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cp_fsync(src: Path, dst: Path) -> Measure:
    """``cp`` (coreutils: copy_file_range/reflink where possible) then fsync of the copy."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "--", str(src), str(dst)], check=True)
    fsync_path(dst)
    return {"seconds": time.perf_counter() - t0}


def sendfile_fsync(src: Path, dst: Path) -> Measure:
    t0 = time.perf_counter()
    size = src.stat().st_size
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = os.sendfile(fout, fin, done, size - done)
            if n == 0:
                break
            done += n
        os.fsync(fout)
    finally:
        os.close(fin)
        os.close(fout)
    return {"seconds": time.perf_counter() - t0}


def cp_plain(src: Path, dst: Path) -> Measure:
    """Restore baseline from a tier: copy to /dev/shm (reads every byte)."""
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    return {"seconds": time.perf_counter() - t0}


def rm(*paths: Path) -> Callable[[], None]:
    def clean() -> None:
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    return clean


def timed_call(fn: Callable[..., Any], *args: Any) -> Measure:
    t0 = time.perf_counter()
    fn(*args)
    return {"seconds": time.perf_counter() - t0}
