"""In-place reuse of unchanged bytes in RAM slots (issue 18, :mod:`strata.client.reuse`): real
tmpfs slots in /dev/shm, the real Checkpointer, a real trainer process killed mid-save."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer
from strata.client.cuda_host import copy_to_host
from strata.client.reuse import confirm
from strata.config import StrataConfig
from strata.format import codec
from strata.format.crc import chunk_crcs
from strata.restore.staging import stage_into_ram
from strata.tiers.posix import PosixTier
from strata.tiers.slots import LocalSlotProvider
from tests.fixtures import lora
from tests.fixtures.sidecar import free_port

pytestmark = pytest.mark.integration

JOB = lora.JOB


def checkpointer(ram: Path) -> Checkpointer:
    return Checkpointer(
        job_id=JOB, ram_dir=ram, rank=0, world_size=1, keep=1, allow_fresh_start=True
    )


def ram_weights(c: Checkpointer, step: int) -> dict[str, torch.Tensor]:
    """Step ``step`` as the RAM tier holds it: verified against its CRC32Cs, then decoded."""
    m = c.ram.get_manifest(JOB, step, 0)
    assert m.verified
    path = c.ram.data_path(JOB, step, 0)
    c.ram.verify_file(path, m)
    tree: Any = codec.load(m, bytearray(path.read_bytes()[: m.data_nbytes]))
    out = {f"base.{k}": v for k, v in tree["base"].items()}
    out.update({f"ad.{k}": v for k, v in tree["adapters"].items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def committed(c: Checkpointer) -> list[int]:
    return sorted(s for s, e in c.ram.list_steps(JOB).items() if e.committed_ranks)


def save(c: Checkpointer, state: dict[str, Any], step: int) -> int:
    """Save ``step``, wait for its commit; the bytes written into the slot."""
    assert c.save(step, state)
    c.wait_copied()
    c.wait()
    n = c.saver.last_copied_nbytes
    assert n is not None
    return n


def test_frozen_base_is_written_once_per_slot_and_every_step_restores(shm_dir: Path) -> None:
    state = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        c.restore(state)
        written = []
        for step in range(1, 9):
            lora.fill(state, step)
            written.append(save(c, state, step))
            assert c.failed_saves == 0, c.last_error
            assert committed(c)[-1] == step
            assert same(ram_weights(c, step), lora.weights(state)), step
        total = c.ram.get_manifest(JOB, 8, 0).data_nbytes
    # Each of the ring's 2 slots takes the whole state once; then only the adapters.
    assert written[:2] == [total, total]
    assert written[2:] == [total - lora.BASE_BYTES] * 6
    assert written[2] < 0.02 * total
    # and a restore (a new trainer) gets the newest step bit for bit
    fresh = lora.make_state()
    lora.fill(fresh, 0)
    with checkpointer(shm_dir / "ram") as c:
        assert c.restore(fresh).step == 8
    lora.fill(state, 8)
    assert same(lora.weights(fresh), lora.weights(state))


def test_a_write_through_data_is_caught_and_never_committed(shm_dir: Path) -> None:
    state = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        c.restore(state)
        for step in range(1, 5):
            lora.fill(state, step)
            save(c, state, step)
        # A 'frozen' weight changed behind the version counter's back.
        frozen = state["base"][1].weight
        before = frozen._version
        frozen.data.copy_(torch.full_like(frozen, 0.5))
        assert frozen._version == before
        lora.fill(state, 5)
        assert c.save(5, state)  # the copy of the changed bytes is done ...
        assert c.wait_copied() is False  # ... but the confirmation refused the commit
        assert c.failed_saves == 1
        assert c.last_error is not None and "version counter" in c.last_error
        assert committed(c) == [4]  # its slot held step 3; step 4 is intact
        # Later saves copy that storage every time and commit the live bytes.
        for step in (6, 7, 8):
            lora.fill(state, step)
            n = save(c, state, step)
            assert c.failed_saves == 1
            assert n >= 512 * 512 * 4 + (
                c.ram.get_manifest(JOB, step, 0).data_nbytes - lora.BASE_BYTES
            )
            assert same(ram_weights(c, step), lora.weights(state))
        live = lora.weights(state)
    fresh = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        assert c.restore(fresh).step == 8
    assert same(lora.weights(fresh), live)
    assert torch.equal(fresh["base"][1].weight, torch.full((512, 512), 0.5))


def test_layout_change_restore_restart_and_a_staged_slot_force_full_copies(
    shm_dir: Path, tmp_path: Path
) -> None:
    ram = shm_dir / "ram"
    pvc = PosixTier(tmp_path / "pvc")
    state = lora.make_state()
    with checkpointer(ram) as c:
        c.restore(state)
        for step in range(1, 5):
            lora.fill(state, step)
            save(c, state, step)
            if step == 1:  # an older copy elsewhere, for the staging below
                pvc.put_shard(JOB, 1, 0, c.ram.data_path(JOB, 1, 0), c.ram.get_manifest(JOB, 1, 0))
        total = c.ram.get_manifest(JOB, 4, 0).data_nbytes
        # 1. the sidecar's staging routine writes another shard into the oldest slot
        stage_into_ram([pvc], c.ram, LocalSlotProvider(c.ram, keep=1), JOB, 1, 0, world_size=1)
        assert committed(c) == [1, 4]
        lora.fill(state, 5)
        assert save(c, state, 5) == total
        lora.fill(state, 6)
        assert save(c, state, 6) == total - lora.BASE_BYTES  # the other slot still had its record
        # 2. a layout change: a new storage in front of the base moves every offset
        moved: dict[str, Any] = {"extra": torch.ones(1000), **state}
        for step in (7, 8):
            lora.fill(state, step)
            n = save(c, moved, step)
            assert n == c.ram.get_manifest(JOB, step, 0).data_nbytes
        lora.fill(state, 9)
        assert save(c, moved, 9) < 0.02 * n
        # 3. a restore writes the live tensors without bumping their version counters
        c.restore(moved)
        for step in (10, 11):
            lora.fill(state, step)
            assert save(c, moved, step) == n
        assert c.failed_saves == 0, c.last_error
        assert same(ram_weights(c, 11), lora.weights(state))
    # 4. a new trainer process knows no slot: full copies until each slot has its record
    with checkpointer(ram) as c:
        c.restore(moved)
        sizes = []
        for step in (12, 13, 14):
            lora.fill(state, step)
            sizes.append(save(c, moved, step))
        assert sizes == [n, n, sizes[2]] and sizes[2] < 0.02 * n
        assert c.failed_saves == 0, c.last_error
        assert same(ram_weights(c, 14), lora.weights(state))


def test_a_trainer_killed_before_the_confirmation_commits_leaves_the_previous_step(
    shm_dir: Path, tmp_path: Path
) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "strata.client", "tests.fixtures.lora"])
    ram = shm_dir / "ram"
    log = tmp_path / "saved.log"
    # Steps 1 and 2 fill the ring; step 3 leaves the base in place and dies in the background
    # before its confirmation commits it.
    p = ctx.Process(target=lora.trainer, args=(str(ram), str(log), "save.confirm=kill"))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == -signal.SIGKILL
    saved = [line.split() for line in log.read_text().splitlines()]
    assert [int(s) for s, _n in saved] == [1, 2]
    state = lora.make_state()
    with checkpointer(ram) as c:
        listing = c.ram.list_steps(JOB)
        assert sorted(listing) == [2]  # step 3 took step 1's slot: not committed, not linked
        assert c.restore(state).step == 2
    expected = lora.make_state()
    lora.fill(expected, 2)
    assert same(lora.weights(state), lora.weights(expected))
    assert os.path.exists(ram / JOB / "slots")


def test_confirm_finds_the_storage_that_differs_across_chunk_boundaries() -> None:
    """:func:`confirm` on a bytearray 'slot' with 4 KiB chunks: storages straddle chunks."""
    a, b, c = torch.arange(3000, dtype=torch.float32), torch.ones(5000), torch.zeros(700)
    enc = codec.encode({"a": a, "b": b, "c": c})
    slot = bytearray(enc.data_nbytes)
    codec.write_data(enc, slot)
    addr = torch.frombuffer(slot, dtype=torch.uint8).data_ptr()
    res = confirm(enc, addr, frozenset({0, 1}), 4096)
    assert res.bad == []
    assert (res.chunk_crc32c, res.crc32c) == chunk_crcs(slot, enc.data_nbytes, 4096)
    b[4321] = 2.0  # live differs from the slot in storage 1 only, mid-chunk
    res = confirm(enc, addr, frozenset({0, 1}), 4096)
    assert res.bad == [1]
    assert (res.chunk_crc32c, res.crc32c) == chunk_crcs(slot, enc.data_nbytes, 4096)
    assert confirm(enc, addr, frozenset({0, 2}), 4096).bad == []  # not skipped: not compared


def test_overlapped_saves_leave_the_base_in_place_and_catch_data_writes(shm_dir: Path) -> None:
    """save(blocking=False): the copy of the changed bytes runs in the background, and
    wait_copied() returns once the confirmation has committed the step (or refused it)."""
    state = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        c.restore(state)
        written = []
        for step in range(1, 6):
            lora.fill(state, step)
            assert c.save(step, state, blocking=False)
            assert c.wait_copied() is True, c.last_error
            assert committed(c)[-1] == step  # committed when wait_copied() returns
            c.wait()
            written.append(c.saver.last_copied_nbytes)
            assert same(ram_weights(c, step), lora.weights(state))
        total = c.ram.get_manifest(JOB, 5, 0).data_nbytes
        assert written == [total, total] + [total - lora.BASE_BYTES] * 3
        state["base"][2].weight.data.mul_(2.0)  # behind the version counter's back
        lora.fill(state, 6)
        assert c.save(6, state, blocking=False)
        assert c.wait_copied() is False
        assert c.failed_saves == 1 and committed(c) == [5]
        lora.fill(state, 7)
        assert c.save(7, state, blocking=False)
        assert c.wait_copied() is True
        c.wait()
        assert same(ram_weights(c, 7), lora.weights(state))
        # blocking and overlapped saves share the records
        lora.fill(state, 8)
        assert save(c, state, 8) == total - 2 * 512 * 512 * 4  # base[2] is copied from now on
        assert same(ram_weights(c, 8), lora.weights(state))


def test_a_frozen_tensor_changed_before_the_confirmation_fails_that_step_only(
    shm_dir: Path,
) -> None:
    """C-01 for bytes left in place: the training loop changes a 'frozen' tensor in place right
    after save() returned, before the background confirmation ran. That step is not committed
    (its bytes can no longer be confirmed); it never commits the changed bytes as step 5."""
    state = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        c.restore(state)
        for step in range(1, 5):
            lora.fill(state, step)
            save(c, state, step)
        gate = threading.Event()
        c.saver._bg.submit(gate.wait)  # the background thread is busy until the change is made
        lora.fill(state, 5)
        assert c.save(5, state)
        saved5 = lora.weights(state)
        with torch.no_grad():
            state["base"][0].weight.add_(1.0)  # a real in-place op: the version counter moves
        gate.set()
        assert c.wait_copied() is False
        assert c.last_error is not None and "changed in place" in c.last_error
        assert committed(c) == [4]
        lora.fill(state, 6)
        save(c, state, 6)
        assert c.failed_saves == 1
        assert same(ram_weights(c, 6), lora.weights(state))
        assert not torch.equal(ram_weights(c, 6)["base.0.weight"], saved5["base.0.weight"])


def test_with_a_real_sidecar_promoting_and_staging(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., Any]
) -> None:
    """The real sidecar promotes every step to the PVC (steps committed after a confirmation
    included) and, for a recreated pod, stages the newest one back into a RAM slot: the saves
    after that copy in full until each slot holds a step this trainer wrote itself."""
    pvc_dir = tmp_path / "pvc"
    config = StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(shm_dir), "every": {"steps": 10}, "keep": 1},
            "pvc": {"path": str(pvc_dir), "every": {"steps": 10}, "keep": 2},
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
            "writer_id": "pod-a",
            "restore": {"allow_fresh_start": True},
        }
    )
    pvc = PosixTier(pvc_dir)

    def run(c: Checkpointer, state: dict[str, Any], steps: list[int]) -> list[int]:
        written = []
        for step in steps:
            lora.fill(state, step)
            written.append(save(c, state, step))
            deadline = time.monotonic() + 60
            while step not in pvc.complete_steps(JOB):
                assert time.monotonic() < deadline, f"step {step} never reached the PVC"
                time.sleep(0.05)
        assert c.failed_saves == 0, c.last_error
        return written

    side = sidecar_proc(config)
    state = lora.make_state()
    with Checkpointer(config, rank=0, world_size=1) as c:
        c.restore(state)
        written = run(c, state, [10, 20, 30, 40])
        total = c.ram.get_manifest(JOB, 40, 0).data_nbytes
    # The first save into each slot copies everything; later ones leave the base in place. (A
    # slot the sidecar still holds when a save needs one grows the ring by a fresh slot, which
    # costs one more full copy: the exact sequence depends on timing, the end state does not.)
    assert written[:2] == [total, total] and written[-1] == total - lora.BASE_BYTES, written
    assert set(written) <= {total, total - lora.BASE_BYTES}, written
    side.kill()
    shutil.rmtree(shm_dir / JOB)  # a recreated pod: the RAM tier is empty
    side = sidecar_proc(config)
    fresh = lora.make_state()
    with Checkpointer(config, rank=0, world_size=1) as c:
        res = c.restore(fresh)
        assert (res.step, res.tier) == (40, "pvc")
        assert same(lora.weights(fresh), lora.weights(state))
        written = run(c, fresh, [50, 60, 70, 80])
        assert written[:2] == [total, total] and written[-1] == total - lora.BASE_BYTES, written
        assert set(written) <= {total, total - lora.BASE_BYTES}, written
        assert same(ram_weights(c, 80), lora.weights(fresh))
    # every step the PVC kept holds the bytes saved
    for step in pvc.complete_steps(JOB):
        m = pvc.get_manifest(JOB, step, 0)
        assert m.refs is None or m.refs.base_step in pvc.complete_steps(JOB)
    restored = lora.make_state()
    shutil.rmtree(shm_dir / JOB)
    with Checkpointer(config, rank=0, world_size=1) as c:
        assert c.restore(restored).step == 80
    assert same(lora.weights(restored), lora.weights(fresh))


def test_write_data_leaves_skipped_storages_untouched() -> None:
    """The copy hooks really skip: the bytes of a skipped storage in the destination stay
    what they were (here a marker no storage holds), every other byte is written."""
    state = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5000)}
    state["c"] = torch.full((700,), 3.0)
    enc = codec.encode(state)
    entry = enc.storages[1]
    for run in ("codec", "host"):
        dst = torch.full((enc.data_nbytes,), 0xAB, dtype=torch.uint8)
        if run == "codec":
            codec.write_data(enc, dst, skip=frozenset({1}))
        else:
            copy_to_host(enc, dst, None, skip=frozenset({1})).wait()
        hole = dst[entry.offset : entry.offset + entry.nbytes]
        assert bool((hole == 0xAB).all()), run
        full = torch.zeros(enc.data_nbytes, dtype=torch.uint8)
        codec.write_data(enc, full)
        outside = torch.ones(enc.data_nbytes, dtype=torch.bool)
        outside[entry.offset : entry.offset + entry.nbytes] = False
        assert torch.equal(dst[outside], full[outside]), run


def test_a_new_storage_at_a_freed_ones_address_is_copied(shm_dir: Path) -> None:
    """The hint is the very storage recorded, not its address: a new tensor over the same
    memory every save (same address, size and version counter; other bytes) is always copied,
    and no save fails its confirmation."""
    buf = bytearray(1 << 20)
    state = lora.make_state()
    with checkpointer(shm_dir / "ram") as c:
        c.restore(state)
        for step in range(1, 7):
            lora.fill(state, step)
            buf[:] = bytes([step]) * len(buf)
            blob = torch.frombuffer(buf, dtype=torch.uint8)  # a new storage over buf
            n = save(c, {"blob": blob, **state}, step)
            assert c.failed_saves == 0, c.last_error
            m = c.ram.get_manifest(JOB, step, 0)
            if step > 2:
                assert n == m.data_nbytes - lora.BASE_BYTES  # the base only is left in place
            tree: Any = codec.load(m, bytearray(c.ram.data_path(JOB, step, 0).read_bytes()))
            assert bool((tree["blob"] == step).all())
            del blob


def test_a_view_dropped_from_the_state_with_the_same_counter_sum_is_copied(
    shm_dir: Path,
) -> None:
    """The hint must not be fooled by a state that drops one of two views of a storage while
    the other one changes once: (0+1) + (0+1) == (1+1). The changed storage is copied, and
    the save commits (no spurious failed save, skipping not turned off)."""
    big = torch.zeros(1 << 18)  # 1 MiB, above MIN_SKIP_BYTES
    with checkpointer(shm_dir / "ram") as c:
        for step in (1, 2):
            save(c, {"w": big, "alias": big.view(-1)}, step)
        assert c.failed_saves == 0, c.last_error
        big.add_(1.0)  # version 0 -> 1; "alias" is no longer saved
        assert big._version == 1
        save(c, {"w": big}, 3)
        assert c.failed_saves == 0, c.last_error
        m = c.ram.get_manifest(JOB, 3, 0)
        tree: Any = codec.load(m, bytearray(c.ram.data_path(JOB, 3, 0).read_bytes()))
        assert bool((tree["w"] == 1.0).all())


@pytest.mark.parametrize("overlapped", [False, True])
def test_every_step_holds_the_live_state_as_its_structure_changes_between_saves(
    shm_dir: Path, overlapped: bool
) -> None:
    """The encode cache (layout replay, spliced manifest JSON) and RAM reuse together, as the
    state changes between saves: values in place, two same-shaped tensors swapped, a tensor
    replaced by a new object (often at the freed one's address), the same storage seen as
    another dtype, a resized tensor, a Parameter's ``.data`` replaced, ``set_()`` onto another
    storage, a key added and one removed. Every committed step decodes, CRC-checked, to exactly
    what was live at its save, and no save fails."""
    n = 1 << 18  # 1 MiB of float32, above MIN_SKIP_BYTES
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {
        "a": torch.randn(n, generator=g),
        "b": torch.randn(n, generator=g),
        "frozen": torch.randn(n, generator=g),
        "p": torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False),
        "small": torch.arange(10),
        "step": 0,
    }

    def new(dtype: torch.dtype = torch.float32, size: int = n) -> torch.Tensor:
        return torch.randn(size, generator=g).to(dtype)

    changes: list[Callable[[dict[str, Any]], None]] = [
        lambda s: s["a"].add_(1.0),
        lambda s: s.update(a=s["b"], b=s["a"]),  # same shapes, other order
        lambda s: s.update(b=new()),  # a new object, likely at the freed one's address
        lambda s: s.update(frozen=s["frozen"].view(torch.int32)),  # same bytes, other dtype
        lambda s: s.update(frozen=s["frozen"].view(torch.float32)),
        lambda s: s.update(a=new(size=n + 1024)),  # resized
        lambda s: setattr(s["p"], "data", new()),  # a Parameter over a new storage
        lambda s: s["b"].set_(new().untyped_storage()),  # the same object, another storage
        lambda s: s.update(extra=new()),  # a key added
        lambda s: s.pop("extra"),  # and removed
        lambda s: s.update(a=s["a"][: n // 2].clone(), b=s["b"].view(2, n // 2)),
        lambda s: None,  # nothing changes: everything large is left in place
    ]
    left_in_place = 0
    with checkpointer(shm_dir / "ram") as c:
        for step in range(1, 2 * len(changes) + 1):
            changes[(step - 1) % len(changes)](state)
            state["step"] = step
            live = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
            if overlapped:  # save(blocking=False): the copy runs in the background
                assert c.save(step, state, blocking=False)
                assert c.wait_copied() is True, (step, c.last_error)
                c.wait()
                written = c.saver.last_copied_nbytes or 0
            else:
                written = save(c, state, step)
            assert c.failed_saves == 0, (step, c.last_error)
            m = c.ram.get_manifest(JOB, step, 0)
            left_in_place += m.data_nbytes - written
            path = c.ram.data_path(JOB, step, 0)
            c.ram.verify_file(path, m)
            tree: Any = codec.load(m, bytearray(path.read_bytes()[: m.data_nbytes]))
            assert tree.keys() == live.keys(), step
            for k, v in live.items():
                if torch.is_tensor(v):
                    got = tree[k]
                    assert got.dtype == v.dtype and got.shape == v.shape, (step, k)
                    assert torch.equal(got, v), (step, k)
                else:
                    assert tree[k] == v, (step, k)
    assert left_in_place >= 8 * n * 4  # reuse was at work, not a full copy every time


_FREED_AFTER_SAVE = """
import sys, torch
from pathlib import Path
from strata.client import Checkpointer

big = torch.zeros(32 << 20)  # 128 MiB, left in place by step 3
with Checkpointer(job_id=sys.argv[2], ram_dir=Path(sys.argv[1]), rank=0, world_size=1, keep=1,
                  allow_fresh_start=True) as c:
    for step in (1, 2):
        assert c.save(step, {"w": big})
        c.wait()
    assert c.save(3, {"w": big})
    big.untyped_storage().resize_(0)  # freed while its confirmation reads it
    c.wait()
    print("failed_saves", c.failed_saves)
    # reallocated, so "changed" (not a write behind the version counter: skipping stays on)
    assert "changed in place before" in (c.last_error or ""), c.last_error
    big.untyped_storage().resize_(128 << 20)
    big.fill_(4.0)
    assert c.save(4, {"w": big})
    c.wait()
    print("failed_saves", c.failed_saves)
"""


def test_a_storage_freed_after_save_fails_that_step_without_crashing_the_trainer(
    shm_dir: Path,
) -> None:
    """save() returned, and the training loop frees a storage the save left in place
    (``untyped_storage().resize_(0)``, or a ``resize_`` that reallocates) while the background
    confirmation reads it: that step fails, the trainer lives on (it was killed by SIGSEGV:
    the confirmation dereferenced the freed memory), the previous step is intact and the next
    save commits."""
    import subprocess
    import sys

    ram = shm_dir / "ram"
    out = subprocess.run(
        [sys.executable, "-c", _FREED_AFTER_SAVE, str(ram), JOB],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["failed_saves", "1", "failed_saves", "1"]
    c = checkpointer(ram)
    try:
        assert committed(c) == [2, 4]
        m = c.ram.get_manifest(JOB, 4, 0)
        path = c.ram.data_path(JOB, 4, 0)
        c.ram.verify_file(path, m)
        tree: Any = codec.load(m, bytearray(path.read_bytes()[: m.data_nbytes]))
        assert bool((tree["w"] == 4.0).all())
    finally:
        c.close()
