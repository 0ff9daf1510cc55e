"""A sidecar killed in the middle of maintenance (collecting a superseded step, back-filling a
live ancestor step), and the one that comes next.

Deleting a step is several operations (the commit record, then each manifest, then each data
file); a sidecar SIGKILLed between two of them leaves a step that is neither whole nor gone. The
next sidecar (a fresh promotion engine over the same tiers: nothing of the dead one's memory
survives) must finish the job: every file of the superseded step goes, no live step is touched,
and a restore from the tier still picks the live run's newest step.

Back-filling a step to GCS is, per rank, a data object then a manifest, then the step's commit
record; a sidecar killed between two of them leaves a step on GCS that no restore may use. The
next sidecar must complete it: every rank verified, committed once, for the step's incarnation.

The kill is a :class:`Killed` (a ``BaseException``, which no round catches) raised from inside a
real :class:`PosixTier` delete at each point, so the state on disk is exactly what a kill there
leaves. The real tiers, incarnation records and engines are those of
:mod:`tests.integration.test_eligible_steps`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strata import faults
from strata.config import StrataConfig, TierName
from strata.format import layout
from strata.restore import collect_inventory, plan_restore
from strata.sidecar.promotion import PromotionEvent
from strata.sidecar.promotion.round import PromotionEngine
from strata.tiers.base import Tier
from strata.tiers.gcs.tier import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import committed_steps, write_incarnation
from tests.fixtures.gcs import GcsEmulator
from tests.integration.test_eligible_steps import JOB, WORLD, X, node, rounds, save, successor

pytestmark = pytest.mark.integration


class Killed(BaseException):
    """The sidecar's process died here (nothing after this point ran)."""


class DyingPosixTier(PosixTier):
    """A real PVC tier whose first ``delete_step`` of ``step`` stops after ``point``:

    - ``record``: the commit record removed, every manifest and data file left;
    - ``one-manifest``: the record and one rank's manifest removed;
    - ``manifests``: the record and every manifest removed, the data left;
    - ``one-data``: the record, the manifests and one rank's data removed.
    """

    def __init__(self, root: Path, step: int, point: str) -> None:
        super().__init__(root)
        self.step, self.point, self.died = step, point, False

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        if step != self.step or self.died or ranks is not None:
            return super().delete_step(job_id, step, ranks)
        self.died = True
        d = self.step_dir(job_id, step)
        (d / layout.COMMIT_NAME).unlink()
        if self.point == "record":
            raise Killed
        self.manifest_path(job_id, step, 0).unlink()
        if self.point == "one-manifest":
            raise Killed
        self.manifest_path(job_id, step, 1).unlink()
        if self.point == "manifests":
            raise Killed
        data = self.data_path(job_id, step, 0)
        assert data is not None
        data.unlink()
        raise Killed


def engine(
    root: Path,
    name: str,
    ranks: list[int],
    tiers: dict[TierName, Tier],
    cfg: dict[str, Any],
    on_event: Callable[[PromotionEvent], None] | None = None,
) -> PromotionEngine:
    """A fresh engine of the sidecar that replaces a dead one on node ``name`` (its RAM kept;
    the configuration as :func:`tests.integration.test_eligible_steps.node` writes it)."""
    d = root / name
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(d), "every": {"steps": 5}, "keep": 1},
        "writer_id": name,
        "gc_grace_seconds": 0,
        **cfg,
    }
    return PromotionEngine(
        StrataConfig.parse(raw), RamTier(d, keep=1), tiers, local_ranks=ranks,
        maintenance_seconds=0, on_event=on_event,
    )  # fmt: skip


def files_of(pvc: Path, step: int) -> list[str]:
    d = PosixTier(pvc).step_dir(JOB, step)
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.mark.parametrize("point", ["record", "one-manifest", "manifests", "one-data"])
def test_a_collector_killed_mid_delete_is_finished_by_the_next_sidecar(
    point: str, shm_dir: Path, tmp_path: Path
) -> None:
    """X committed 10 and 20 on the PVC; the job restored 10 (Y) on node c, so X's 20 is
    superseded. Y commits 15 and 25; node c's sidecar collects 20 and is killed at ``point``.
    Its replacement finishes: nothing of 20 is left, X's 10 and Y's steps are intact."""
    pvc_root = tmp_path / "pvc"
    cfg = {"pvc": {"path": str(pvc_root), "every": {"steps": 5}, "keep": 10}}
    ram_a, a = node(shm_dir, "node-a", [0], {"pvc": PosixTier(pvc_root)}, cfg)
    ram_b, b = node(shm_dir, "node-b", [1], {"pvc": PosixTier(pvc_root)}, cfg)
    for ram in (ram_a, ram_b):
        write_incarnation(ram, X)
    for step in (10, 20):
        save(ram_a, step, [0], X, "node-a")
        save(ram_b, step, [1], X, "node-b")
        rounds([a, b])
    assert sorted(committed_steps(PosixTier(pvc_root), JOB)) == [10, 20]
    assert len(files_of(pvc_root, 20)) == 5  # the record, two manifests, two data files

    # nodes a and b are gone; Y restored X's 10 on node c
    y = successor(10)
    dying = DyingPosixTier(pvc_root, 20, point)
    ram_c, c = node(shm_dir, "node-c", [0, 1], {"pvc": dying}, cfg)
    write_incarnation(ram_c, y)
    save(ram_c, 15, [0, 1], y, "node-c")
    rounds([c])
    save(ram_c, 25, [0, 1], y, "node-c")
    with pytest.raises(Killed):
        rounds([c], n=5)
    assert dying.died
    left = files_of(pvc_root, 20)
    assert left and layout.COMMIT_NAME not in left, left  # neither whole nor gone

    # the replacement sidecar of node c: a fresh engine, the same RAM and PVC
    c2 = engine(shm_dir, "node-c", [0, 1], {"pvc": PosixTier(pvc_root)}, cfg)
    rounds([c2], n=3)
    assert files_of(pvc_root, 20) == [], files_of(pvc_root, 20)
    pvc = PosixTier(pvc_root)
    assert 20 not in pvc.step_numbers(JOB)
    live = committed_steps(pvc, JOB)
    assert {s: cm.incarnation for s, cm in live.items()} == {10: X.id, 15: y.id, 25: y.id}
    for s in (10, 15, 25):
        for r in range(WORLD):
            pvc.verify_shard(JOB, s, r)
    invs = [collect_inventory([pvc], JOB, r, WORLD) for r in range(WORLD)]
    chosen = plan_restore(invs, WORLD)
    assert chosen is not None and (chosen.step, chosen.incarnation) == (25, y.id)


@pytest.mark.parametrize("nth", [1, 2], ids=["first-data-object", "second-data-object"])
def test_a_back_fill_killed_mid_upload_is_completed_by_the_next_sidecar(
    nth: int,
    monkeypatch: pytest.MonkeyPatch,
    shm_dir: Path,
    tmp_path: Path,
    gcs_emulator: GcsEmulator,
    gcs_bucket: str,
) -> None:
    """X reached GCS with step 10 only; 20 and 30 reached the PVC when both nodes died. Y
    restored 30 on node c, whose sidecar back-fills 30 to GCS and is killed just after its
    ``nth`` data object is stored (that rank's manifest not uploaded, no commit record). Until
    the replacement sidecar completes it, no restore from GCS picks 30; then GCS alone restores
    it, every shard verified."""
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, prefix="p")
    pvc_root = tmp_path / "pvc"
    cfg = {
        "pvc": {"path": str(pvc_root), "every": {"steps": 10}, "keep": 3},
        "gcs": {
            "bucket": gcs_bucket,
            "prefix": "p",
            "endpoint": gcs_emulator.endpoint,
            "every": {"steps": 10},
            "keep": 1,
        },
    }

    def tiers(writer: str) -> dict[TierName, Tier]:
        return {
            "pvc": PosixTier(pvc_root),
            "gcs": GcsTier(gcs_cfg, writer_id=writer, client=gcs_emulator.client()),
        }

    ram_a, a = node(shm_dir, "node-a", [0], tiers("node-a"), cfg)
    ram_b, b = node(shm_dir, "node-b", [1], tiers("node-b"), cfg)
    for ram in (ram_a, ram_b):
        write_incarnation(ram, X)
    save(ram_a, 10, [0], X, "node-a")
    save(ram_b, 10, [1], X, "node-b")
    rounds([a, b])
    for step in (20, 30):
        save(ram_a, step, [0], X, "node-a")
        save(ram_b, step, [1], X, "node-b")
        rounds([a, b], force_tier="pvc")
    gcs = GcsTier(gcs_cfg, writer_id="reader", client=gcs_emulator.client())
    assert sorted(committed_steps(gcs, JOB)) == [10]

    real_point = faults.point
    uploads = []

    def point(name: str) -> None:
        if name == "gcs.data_uploaded":
            uploads.append(name)
            if len(uploads) == nth:
                raise Killed
        real_point(name)

    y = successor(30)
    ram_c, c = node(shm_dir, "node-c", [0, 1], tiers("node-c"), cfg)
    write_incarnation(ram_c, y)
    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(Killed):
        rounds([c], n=3)
    monkeypatch.setattr(faults, "point", real_point)
    assert len(uploads) == nth
    assert 30 not in committed_steps(gcs, JOB)
    write_incarnation(gcs, y)
    invs = [collect_inventory([gcs], JOB, r, WORLD) for r in range(WORLD)]
    chosen = plan_restore(invs, WORLD)
    assert chosen is None or chosen.step != 30, chosen  # a half-copied step is no source

    events: list[PromotionEvent] = []
    c2 = engine(shm_dir, "node-c", [0, 1], tiers("node-c"), cfg, on_event=events.append)
    rounds([c2], n=3)
    # said as a back-fill (an older step, not this pod's newest promotion), then committed
    on_30 = [(e.kind, e.tier) for e in events if e.step == 30 and e.tier == "gcs"]
    assert ("backfilled", "gcs") in on_30 and ("committed", "gcs") in on_30, on_30
    assert ("promoted", "gcs") not in on_30, on_30
    on_gcs = committed_steps(gcs, JOB)
    assert sorted(on_gcs) == [30], sorted(on_gcs)
    assert on_gcs[30].incarnation == X.id and on_gcs[30].world_size == WORLD
    for r in range(WORLD):
        gcs.verify_shard(JOB, 30, r)
    invs = [collect_inventory([gcs], JOB, r, WORLD) for r in range(WORLD)]
    chosen = plan_restore(invs, WORLD)
    assert chosen is not None and (chosen.step, chosen.incarnation) == (30, X.id)
