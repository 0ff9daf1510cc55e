"""Issue 18 figure: GCS bytes per archive step for a FULL fine-tune (every weight trained by
AdamW, so the optimizer state is 2/3 of the checkpoint), weights only vs everything.

The real Checkpointer saves into a tmpfs RAM tier; the real promotion engine copies each step to
fake-gcs-server twice, in one run: to a bucket that keeps every component and to one configured
``components: [model]`` (archive-only, weights only). Byte counts are exact (the engine's
``promoted`` events); the times depend on the machine.

Run: ``python -m bench.archive [--model-mib 256] [--steps 2] [--out FILE]``. Needs fake-gcs-server
(``strata.testing.emulator``) and ~4x ``--model-mib`` of free memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from strata import Checkpointer
from strata.config import StrataConfig
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.testing.emulator import FakeGcsServer
from strata.tiers.gcs import GcsTier
from strata.tiers.ram import RamTier

JOB = "bench.fullft"
MIB = 1024 * 1024


def full_finetune_state(model_mib: int, dim: int = 2048) -> tuple[dict[str, Any], Any]:
    """``model_mib`` MiB of fp32 weights (dim x dim Linear layers), all trained by AdamW (two
    moments per weight); returns (state, one training step)."""
    n = max(1, model_mib * MIB // (dim * dim * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()

    return {"model": model, "optim": opt, "step": 0}, step


def run(model_mib: int, steps: int, root: Path, gcs: FakeGcsServer) -> dict[str, Any]:
    state, train = full_finetune_state(model_mib)
    client = gcs.client(project="bench")
    tiers: dict[str, GcsTier] = {}
    cfgs: dict[str, StrataConfig] = {}
    for name, extra in (("full", {}), ("weights", {"components": ["model"]})):
        bucket = f"bench-archive-{name}"
        client.create_bucket(bucket)
        gcs_cfg = {"bucket": bucket, "endpoint": gcs.endpoint, "every": {"steps": 10}, "keep": 1}
        cfgs[name] = StrataConfig.parse(
            {
                "job_id": JOB,
                "ram": {"path": str(root / "ram"), "every": {"steps": 10}, "keep": 1},
                "gcs": {**gcs_cfg, "incremental": False, **extra},
                "writer_id": "bench",
                "gc_grace_seconds": 0,
            }
        )
        tiers[name] = GcsTier(cfgs[name].gcs, writer_id="bench", client=client)  # type: ignore[arg-type]
    ram = RamTier(root / "ram", keep=1)
    events: dict[str, list[PromotionEvent]] = {"full": [], "weights": []}
    engines = {
        name: PromotionEngine(cfgs[name], ram, {"gcs": tiers[name]}, on_event=events[name].append)
        for name in tiers
    }
    rows = []
    with Checkpointer(cfgs["full"], rank=0, world_size=1) as c:
        for i in range(1, steps + 1):
            s = 10 * i
            train(s)
            state["step"] = s
            assert c.save(s, state), c.last_error
            c.wait()
            row: dict[str, Any] = {"step": s, "ram_bytes": ram.get_manifest(JOB, s, 0).data_nbytes}
            for name, engine in engines.items():
                t0 = time.perf_counter()
                engine.promote_once()
                row[f"{name}_promote_s"] = time.perf_counter() - t0
                row[f"{name}_gcs_bytes"] = sum(
                    e.nbytes for e in events[name] if e.kind == "promoted" and e.step == s
                )
            row["weights_over_full"] = row["weights_gcs_bytes"] / row["full_gcs_bytes"]
            rows.append(row)
            print(row, flush=True)
    for t in tiers.values():
        t.close()
    params = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    return {"model_bytes": params, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="RAM tier (tmpfs)")
    args = ap.parse_args()
    with (
        FakeGcsServer(backend="filesystem") as gcs,
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
    ):
        doc = {"model_mib": args.model_mib, **run(args.model_mib, args.steps, Path(tmp), gcs)}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
