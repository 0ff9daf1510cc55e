"""This rank's RAM slot ring as the save path maps it: :class:`SlotRing`.

The slots are files of the RAM tier (:mod:`strata.tiers.slots`); here they are mapped into the
trainer's memory (``MAP_POPULATE``), registered with CUDA when the state holds CUDA tensors
(:mod:`strata.client.cuda_host`), and prepared before a save needs them: :meth:`SlotRing.prepare`
allocates and maps every slot of the ring, so no save pays slot allocation or first-touch page
faults. A save writes only through a mapping of exactly the inode its write lock holds
(:meth:`SlotRing.mapping`). A restore reads the same mappings (:meth:`SlotRing.mapping_of`,
:meth:`SlotRing.host_view`).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from strata.client.cuda_host import HostRegistry, RegisteredSlotMaps, side_streams
from strata.errors import TierError
from strata.format import codec, layout
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotProvider, SlotWriteLock, path_identity, slots_dir


class SlotRing:
    """The slots of rank ``rank`` of ``job_id`` in ``ram`` (from ``slot_provider``), mapped.
    ``register_limit_bytes``: the most slot bytes page-locked with CUDA at once (None: the
    driver's limits only)."""

    def __init__(
        self,
        ram: RamTier,
        slot_provider: SlotProvider,
        job_id: str,
        rank: int,
        register_limit_bytes: int | None = None,
    ) -> None:
        self.ram = ram
        self.slot_provider = slot_provider
        self.job_id = job_id
        self.rank = rank
        self.host = HostRegistry(register_limit_bytes)
        """Page-locked (CUDA-registered) host memory (:mod:`strata.client.cuda_host`)."""
        self.maps = RegisteredSlotMaps(self.host)
        self._streams: dict[Any, Any] = {}
        self.prepared: tuple[int, bool] | None = None
        """(bytes, CUDA) the ring was last prepared for (None: not yet)."""

    def stream(self, enc: codec.EncodedState) -> Any:
        """The side stream for ``enc``'s device copies (None: a CPU state); one per device."""
        return side_streams(enc, self.maps, self._streams)

    def mapping(self, lock: SlotWriteLock) -> Any:
        """The mapping of exactly the inode ``lock`` holds (the trainer never writes through a
        mapping of a file that is no longer the slot). Raises TierError."""
        mm = self.maps.get(lock.path)
        if self.maps.identity(lock.path) != lock.identity:
            self.maps.forget(lock.path)
            mm = self.maps.get(lock.path)
            if self.maps.identity(lock.path) != lock.identity:
                raise TierError(
                    f"RAM slot {lock.path} was replaced while locked; this save is skipped"
                )
        return mm

    def is_registered(self, path: Path) -> bool:
        return self.maps.is_registered(path)

    def prepare(self, nbytes: int, cuda: bool = False) -> int:
        """Allocate the ring for states of ``nbytes`` bytes and map (pre-fault) every slot that
        holds them, registering them with CUDA when ``cuda``; the number of slots mapped.

        Taking a slot may un-commit the oldest RAM step beyond ``ram.keep``, as the next save
        would. Raises what slot allocation raises (:class:`strata.errors.TierFull`, ...).
        """
        if nbytes <= 0:
            return 0
        if cuda:
            self.maps.register = True
        if len(self.slots_for(nbytes)) < self.ram.keep + 1:
            # The provider allocates the whole ring on first use. Only then: taking a slot
            # lock here while a save looks for one would make that save skip the slot.
            with SlotWriteLock.acquire(self.slot_provider, self.job_id, self.rank, nbytes):
                pass
        mapped = 0
        for path in self.slots_for(nbytes):
            self.maps.get(path)
            mapped += 1
        self.prepared = (nbytes, cuda)
        return mapped

    def needs_prepare(self, nbytes: int) -> tuple[int, bool] | None:
        """After a save of ``nbytes``: the (bytes, CUDA) to prepare the rest of the ring for
        (the first save, a larger state, CUDA registration turned on), else None. Records it as
        prepared."""
        cuda = self.maps.register
        if self.prepared is None or self.prepared[0] < nbytes or self.prepared[1] != cuda:
            self.prepared = (nbytes, cuda)
            return self.prepared
        return None

    def slots_for(self, nbytes: int) -> list[Path]:
        """This rank's slot files of at least ``nbytes`` bytes, sorted."""
        try:
            entries = list(os.scandir(slots_dir(self.ram.root, self.job_id, self.rank)))
        except FileNotFoundError:
            return []
        return sorted(
            Path(e.path)
            for e in entries
            if layout.parse_slot(e.name) is not None and e.stat().st_size >= nbytes
        )

    def host_view(self, data_path: Path) -> torch.Tensor | None:
        """A 1-D uint8 CPU tensor over this rank's RAM slot that is ``data_path`` (a committed
        shard's data file: the same inode), mapped and registered with CUDA, so that a restore
        copies host-to-device from page-locked memory; the registration stays for the next
        saves into that slot. None when ``data_path`` is no slot of this rank or registration
        is unavailable (see :mod:`strata.client.cuda_host`)."""
        ino = os.stat(data_path).st_ino
        for slot in self.slots_for(0):
            if os.stat(slot).st_ino == ino:
                self.maps.register = True
                mm = self.maps.get(slot)
                if not self.maps.is_registered(slot):
                    return None
                return torch.frombuffer(mm, dtype=torch.uint8)
        return None

    def mapping_of(self, data_path: Path) -> mmap.mmap | None:
        """This process's populated mapping of the RAM slot that is ``data_path`` (the same
        inode), if it already maps one (never maps here): a restore reads it without a page
        fault. None otherwise."""
        return self.maps.mapping_of(path_identity(data_path))

    def close(self) -> None:
        """Unregister and unmap every slot."""
        self.maps.close()
        self.host.close()
