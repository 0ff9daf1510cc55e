"""Copies this sidecar holds for its peers, in its own RAM directory (tmpfs), apart from its steps.

Layout (the RAM tier's own ``<job>/steps`` and ``<job>/slots`` are never touched)::

    <ram root>/<job>/peers/<owner>/steps/<step:012d>/rank-RRRRR.data       replica data
    <ram root>/<job>/peers/<owner>/steps/<step:012d>/rank-RRRRR.manifest   the owner's manifest,
                                                                          byte for byte, LAST
    <ram root>/<job>/parity/<step:012d>/parity.data                       this holder's parity
    <ram root>/<job>/parity/<step:012d>/parity.json                       ParityRecord, LAST

Commit protocol, as in every tier: data under a temporary name, fsync, rename; then the record
(manifest / parity.json) under a temporary name, fsync, rename (the commit point), fsync the
directory. A copy without its record is partial and never served; the next round replaces it.
Memory: these files are tmpfs pages charged to the sidecar container (size it for them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from strata.format import layout
from strata.peers.config import check_peer_id
from strata.peers.wire import ParityRecord
from strata.tiers.durability import fsync_file, write_atomic

PARITY_DATA = "parity.data"
PARITY_RECORD = "parity.json"


class PeerStore:
    """Replica and parity files of job ``job_id`` under ``ram_root`` (see the module docstring)."""

    def __init__(self, ram_root: str | os.PathLike[str], job_id: str) -> None:
        self.root = Path(ram_root) / job_id
        self.job_id = job_id

    def ram_usage(self) -> int:
        """Bytes allocated under the whole RAM directory (every job, slots and copies): what
        counts against the emptyDir ``sizeLimit``."""
        total = 0
        for root, _dirs, files in os.walk(self.root.parent):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total

    # -- replicas ---------------------------------------------------------------------------------

    def replica_dir(self, owner: str, step: int) -> Path:
        return self.root / "peers" / check_peer_id(owner) / "steps" / layout.step_name(step)

    def replica_paths(self, owner: str, step: int, rank: int) -> tuple[Path, Path]:
        d = self.replica_dir(owner, step)
        stem = layout.shard_stem(rank)
        return d / f"{stem}{layout.DATA_SUFFIX}", d / f"{stem}{layout.MANIFEST_SUFFIX}"

    def temp_data(self, owner: str, step: int, rank: int) -> Path:
        """A fresh temporary path next to the replica (the caller fills it, then commits)."""
        data, _ = self.replica_paths(owner, step, rank)
        data.parent.mkdir(parents=True, exist_ok=True)
        return data.with_name(f"{data.name}.tmp-{uuid.uuid4().hex[:8]}")

    def commit_replica(
        self, owner: str, step: int, rank: int, tmp_data: Path, raw_manifest: bytes
    ) -> None:
        """fsync ``tmp_data``, rename it to the replica's data, then write the manifest LAST."""
        data, man = self.replica_paths(owner, step, rank)
        with contextlib.suppress(FileNotFoundError):
            man.unlink()  # a previous copy of the same shard is un-committed first
        fsync_file(tmp_data)
        os.rename(tmp_data, data)
        write_atomic(man, raw_manifest)

    def read_replica_manifest(self, owner: str, step: int, rank: int) -> bytes:
        """Raw manifest bytes; ``FileNotFoundError`` when the replica is not committed."""
        return self.replica_paths(owner, step, rank)[1].read_bytes()

    def replicas(self) -> dict[str, dict[int, list[int]]]:
        """Owner -> step -> ranks with a committed replica (manifest present)."""
        out: dict[str, dict[int, list[int]]] = {}
        base = self.root / "peers"
        with contextlib.suppress(FileNotFoundError):
            for owner in sorted(os.listdir(base)):
                steps_dir = base / owner / "steps"
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for name in os.listdir(steps_dir):
                        step = layout.parse_step(name)
                        if step is None:
                            continue
                        ranks = sorted(
                            parsed[0]
                            for f in os.listdir(steps_dir / name)
                            if (parsed := layout.parse_shard(f)) and parsed[1] == "manifest"
                        )
                        if ranks:
                            out.setdefault(owner, {})[step] = ranks
        return out

    def delete_replica_step(self, owner: str, step: int) -> None:
        """Manifests first (un-commit), then everything else of that step."""
        d = self.replica_dir(owner, step)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(d):
                if name.endswith(layout.MANIFEST_SUFFIX):
                    (d / name).unlink()
        shutil.rmtree(d, ignore_errors=True)

    def replica_steps(self, owner: str) -> list[int]:
        """Every step directory of ``owner`` (committed or partial), ascending."""
        d = self.root / "peers" / check_peer_id(owner) / "steps"
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        return sorted(s for n in names if (s := layout.parse_step(n)) is not None)

    # -- parity -----------------------------------------------------------------------------------

    def parity_dir(self, step: int) -> Path:
        return self.root / "parity" / layout.step_name(step)

    def parity_temp(self, step: int) -> Path:
        d = self.parity_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{PARITY_DATA}.tmp-{uuid.uuid4().hex[:8]}"

    def commit_parity(self, step: int, tmp_data: Path, record: ParityRecord) -> None:
        d = self.parity_dir(step)
        with contextlib.suppress(FileNotFoundError):
            (d / PARITY_RECORD).unlink()
        fsync_file(tmp_data)
        os.rename(tmp_data, d / PARITY_DATA)
        write_atomic(d / PARITY_RECORD, record.model_dump_json().encode())

    def parity_steps(self) -> list[int]:
        """Steps with a committed parity record, ascending."""
        base = self.root / "parity"
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return []
        return sorted(
            s
            for n in names
            if (s := layout.parse_step(n)) is not None and (base / n / PARITY_RECORD).exists()
        )

    def all_parity_steps(self) -> list[int]:
        base = self.root / "parity"
        try:
            return sorted(s for n in os.listdir(base) if (s := layout.parse_step(n)) is not None)
        except FileNotFoundError:
            return []

    def read_parity_record(self, step: int) -> bytes:
        return (self.parity_dir(step) / PARITY_RECORD).read_bytes()

    def parity_data_path(self, step: int) -> Path:
        return self.parity_dir(step) / PARITY_DATA

    def delete_parity_step(self, step: int) -> None:
        d = self.parity_dir(step)
        with contextlib.suppress(FileNotFoundError):
            (d / PARITY_RECORD).unlink()
        shutil.rmtree(d, ignore_errors=True)
