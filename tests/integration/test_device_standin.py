"""Every CUDA branch of save, overlapped save and restore, run on the CPU under the device seam's
stand-in (:class:`strata.client.device.StandInDevice`): copies land later on a worker per
stream, events complete when their copies do, registration can fail, several devices."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer, device
from strata.client.cuda_host import HostRegistry, RegisteredSlotMaps, copy_to_host
from strata.client.device import HOST_REGISTER_PORTABLE, DeviceError, StandInDevice
from strata.format import codec

pytestmark = pytest.mark.integration
JOB = "ns.standin"


@pytest.fixture
def held() -> Iterator[StandInDevice]:
    """Two stand-in devices whose stream work runs only when some wait needs it."""
    dev = StandInDevice(devices=2, hold=True)
    with device.use(dev):
        yield dev
    dev.close()


def _state(dev: StandInDevice, index: int = 0, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": dev.tensor(torch.randn(1 << 16, generator=g), index),
        "bf16": dev.tensor(torch.randn(333, generator=g).to(torch.bfloat16), index),
        "cpu": torch.randn(77, generator=g),
    }


def _zeroed(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


def test_a_copy_not_waited_for_leaves_the_slot_torn(held: StandInDevice) -> None:
    """The property every other test here leans on: bytes land only when a wait needs them."""
    state = _state(held)
    enc = codec.encode(state, rank=0, world_size=1)
    slot = torch.zeros(enc.data_nbytes, dtype=torch.uint8)
    reg = HostRegistry(device=held)
    assert reg.register(slot.data_ptr(), slot.numel(), 0)
    handle = copy_to_host(enc, slot, None)
    w = enc.storages[0]
    src = state["w"].view(torch.uint8)
    assert not torch.equal(slot[w.offset : w.offset + w.nbytes], src)  # not landed yet
    handle.wait()
    assert torch.equal(slot[w.offset : w.offset + w.nbytes], src)
    reg.close()


def test_a_copy_into_pageable_memory_is_synchronous(held: StandInDevice) -> None:
    state = _state(held)
    enc = codec.encode(state, rank=0, world_size=1)
    slot = torch.zeros(enc.data_nbytes, dtype=torch.uint8)
    copy_to_host(enc, slot, None)  # no wait: CUDA copies into pageable memory synchronously
    w = enc.storages[0]
    assert torch.equal(slot[w.offset : w.offset + w.nbytes], state["w"].view(torch.uint8))


def test_a_copy_on_another_devices_stream_is_refused(held: StandInDevice) -> None:
    """What the single side stream of device 0 did with a state's device-1 tensors."""
    t = held.tensor(torch.ones(8), 1)
    with pytest.raises(DeviceError, match="current stream"):
        held.copy(torch.zeros(32, dtype=torch.uint8), t, held.stream(0))


@pytest.mark.parametrize("blocking", [True, False])
def test_device_state_saves_and_restores_bit_exact_through_registered_slots(
    held: StandInDevice, shm_dir: Path, blocking: bool
) -> None:
    state = _state(held)
    saved = {k: v.clone() for k, v in state.items()}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c:
        assert c.save(1, state)  # the first save registers the ring (in the background)
        c.wait()
        assert c.save(2, state, blocking=blocking)
        assert c.wait_copied() in (True, None)
        c.wait()
        assert c.saver.host.registered_bytes > 0
        regs = list(held.registrations.values())
        assert regs and all(flags == HOST_REGISTER_PORTABLE for _, _, flags in regs)
        assert held.copies[-1] == (0, "d2h")
        _zeroed(state)
        before = len(held.copies)
        res = c.restore(state)
        assert res.step == 2 and res.tiers == {0: "ram"}
        # the device tensors came host-to-device from the registered slot (the fast path)
        assert [kind for _, kind in held.copies[before:]] == ["h2d", "h2d"]
    for k in saved:
        assert torch.equal(state[k].view(torch.uint8), saved[k].view(torch.uint8)), k


def test_a_state_on_two_devices_commits_only_once_both_devices_copies_landed(
    held: StandInDevice, shm_dir: Path
) -> None:
    """One stream, wait_stream and event per device: the commit waits for every device."""
    g = torch.Generator().manual_seed(5)
    state = {
        "a": held.tensor(torch.randn(50_000, generator=g), 0),
        "b": held.tensor(torch.randn(70_000, generator=g), 1),
    }
    saved = {k: v.clone() for k, v in state.items()}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c:
        assert c.save(1, state)
        c.wait()
        assert c.save(2, state, blocking=False) and c.wait_copied() is True
        c.wait()
        assert {i for i, kind in held.copies if kind == "d2h"} == {0, 1}
        # the committed bytes are the live ones (the checksum pass read the slot after commit)
        data = c.ram.data_path(JOB, 2, 0).read_bytes()
        m = c.ram.get_manifest(JOB, 2, 0)
        for k, te in zip(["a", "b"], m.tensors, strict=True):
            se = m.storages[te.storage]
            assert data[se.offset : se.offset + se.nbytes] == saved[k].numpy().tobytes(), k
        _zeroed(state)
        assert c.restore(state).step == 2
        assert {i for i, kind in held.copies if kind == "h2d"} == {0, 1}
    for k in saved:
        assert torch.equal(state[k], saved[k]), k


def test_registration_is_made_with_the_states_device_current(
    held: StandInDevice, shm_dir: Path
) -> None:
    state = {"w": held.tensor(torch.randn(4096), 1)}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c:
        assert c.save(1, state)
        c.wait()
        assert c.save(2, state)
        c.wait()
        regs = list(held.registrations.values())
    # device 1 current while registering (not device 0: no context there for this rank)
    assert regs and {index for _, index, _ in regs} == {1}
    assert held.registrations == {}  # unregistered when the checkpointer closed


def test_a_refused_registration_falls_back_per_slot_and_says_so_once(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dev = StandInDevice(hold=True, register_error=2)  # cudaErrorMemoryAllocation
    state = {"w": dev.tensor(torch.randn(10_000))}
    saved = state["w"].clone()
    with (
        device.use(dev),
        caplog.at_level(logging.WARNING, logger="strata.client"),
        Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c,
    ):
        for step in range(1, 4):
            assert c.save(step, state)
            c.wait()
        assert c.save(4, state, blocking=False) and c.wait_copied() is True
        c.wait()
        assert c.saver.host.registered_bytes == 0
        assert c.saver.host.fallback_reason is None  # one refusal does not disable the registry
        calls = dev.register_calls
        assert c.save(5, state)
        c.wait()
        assert dev.register_calls == calls  # a refused mapping is not retried on every save
        state["w"].zero_()
        assert c.restore(state).step == 5
    dev.close()
    assert torch.equal(state["w"], saved)
    refused = [r for r in caplog.records if "could not be registered" in r.getMessage()]
    assert len(refused) == 1 and "error 2" in refused[0].getMessage()


def test_a_slow_registration_holds_no_lock_a_save_needs(tmp_path: Path) -> None:
    dev = StandInDevice()
    dev.register_gate = threading.Event()
    reg = HostRegistry(device=dev)
    maps = RegisteredSlotMaps(reg)
    maps.register = True
    a, b = tmp_path / "slot-a", tmp_path / "slot-b"
    for p in (a, b):
        p.write_bytes(b"\0" * (1 << 16))
    bg = threading.Thread(target=maps.get, args=(a,), daemon=True)
    bg.start()
    while dev.register_calls == 0:
        threading.Event().wait(0.001)
    # while slot a's registration is in the driver: the mapping, the registry and another slot
    out: list[object] = []
    fg = threading.Thread(
        target=lambda: out.extend([maps.get(a), reg.registered_bytes, maps.is_registered(a)]),
        daemon=True,
    )
    fg.start()
    fg.join(30)  # a hang guard, not a timing assertion
    finished = not fg.is_alive()
    dev.register_gate.set()
    bg.join(30)
    assert finished, "a save's lookup of its slot waited for another thread's registration"
    assert out[1:] == [0, False]
    maps.get(b)
    assert maps.is_registered(a) and maps.is_registered(b)
    maps.close()
    reg.close()
    assert dev.registrations == {}
    dev.close()


def test_an_overlapped_save_into_an_unregistered_slot_says_it_blocks(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from strata.client import cuda_host

    cuda_host._warned_sync = False
    dev = StandInDevice(register_error=2)
    state = {"w": dev.tensor(torch.randn(1000))}
    with (
        device.use(dev),
        caplog.at_level(logging.WARNING, logger="strata.client"),
        Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c,
    ):
        assert c.save(1, state, blocking=False) and c.wait_copied() is True
    dev.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any("into a RAM slot that is not registered" in m for m in lines), lines


def test_close_runs_held_work_and_joins_every_stream_worker() -> None:
    """A worker left inside a torch op when the interpreter finalizes aborts the process
    ("terminate called without an active exception"): close() must leave none running."""
    dev = StandInDevice(devices=1, hold=True)
    dst, src = dev.tensor(torch.zeros(1 << 12)), torch.arange(1 << 12, dtype=torch.float32)
    s = dev.stream(0)
    dev.copy(dst, src, s)  # held: nothing waits for it
    dev.current_stream(0).enqueue(lambda: None)  # type: ignore[attr-defined]
    dev.close()
    assert torch.equal(dst, src)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("standin-stream-")]
