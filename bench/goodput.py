"""Goodput of a job on N accelerators under a published failure rate: Strata's tiers (with and
without peers) against the best single-tier checkpoint at its Young/Daly interval.

The model (each term per unit of wall time; every failure class restores from one level):

- a *level* ``j`` (RAM, peers, PVC, GCS) is checkpointed every ``tau_j`` seconds at a cost
  ``a_j`` per checkpoint (RAM: the training stall of a save; a background copy: its seconds
  times the measured interference fraction, the share of training throughput it takes while it
  runs), and a step is in it ``latency_j`` seconds after the step;
- failure class ``k`` (node-local, node loss, zone loss) is a fraction ``f_k`` of the job's
  failures (mean time between failures ``M``) and restores from level ``j(k)``: it loses on
  average ``tau_j / 2 + latency_j`` of work plus the restart ``R`` (reschedule, plan, load);

    goodput = 1 - sum_j a_j / tau_j - sum_k f_k (tau_j(k) / 2 + latency_j(k) + R_j(k)) / M

which per level is Young's trade-off with that level's own MTBF ``M / F_j`` (``F_j``: the
failure fraction it serves), so ``tau_j = max(floor_j, sqrt(2 a_j M / F_j))`` (``floor_j``: a
copy cannot start before the previous one ended, nor more often than the RAM checkpoints it
copies). With one level serving every failure this is :func:`bench.youngdaly.goodput`.

Inputs: ``bench/results/latest.json`` (``make bench``: save stall, commit, promotion and restore
seconds per rank, interference fraction), ``bench/results/peers.json`` (peer replication
seconds), ``bench/results/scale-data.json`` (``make scale-data``: commit latency in rounds,
planner and inventory parse time at W); the rest are stated assumptions (:data:`ASSUMPTIONS`),
printed with the table. Run: ``python -m bench.goodput`` (``make goodput``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")

# Meta, "The Llama 3 Herd of Models" (2024), section 3.3.4: 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs, 78% of them attributed to hardware.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
LLAMA3_HARDWARE = 0.78

ASSUMPTIONS: dict[str, Any] = {
    "failure_mix": {
        # Not hardware (software, host maintenance, user code): the process restarts on the
        # same node and its RAM tier survives.
        "node_local": round(1.0 - LLAMA3_HARDWARE, 2),
        # Hardware (GPU, HBM, host, NIC...): the node is replaced; its RAM tier is gone.
        "node_loss": round(LLAMA3_HARDWARE - 0.01, 2),
        # A zone (its nodes and zonal PVC) lost; Llama 3 reports none: 1% as a margin.
        "zone_loss": 0.01,
    },
    "failures_scale_with_accelerators": True,
    "restart_s": 60.0,  # reschedule, process start, process-group init (not measured here)
    "pvc_aggregate_GBps": 100.0,  # a shared file system's read bandwidth for the whole job
    "gcs_aggregate_GBps": 25.0,  # a bucket's egress for the whole job (200 Gbit/s)
    "ranks_per_node": 8,
}


@dataclass(frozen=True)
class Level:
    """A place a checkpoint is restored from. Seconds per rank unless said otherwise."""

    name: str
    cost_s: float
    """Training time lost per checkpoint into this level (stall, or copy seconds x
    interference)."""
    latency_s: float
    """From the step to its checkpoint being in this level (lost on top of half an interval)."""
    restore_s: float
    """Time to load the state from this level after a failure (the job waits for it)."""
    floor_s: float = 0.0
    """The shortest interval this level can be checkpointed at."""


@dataclass(frozen=True)
class Scenario:
    name: str
    levels: Mapping[str, Level]
    served_by: Mapping[str, str]
    """Failure class -> the level it restores from."""
    notes: tuple[str, ...] = field(default_factory=tuple)


def intervals(
    s: Scenario, mix: Mapping[str, float], mtbf_s: float, base: str | None = None
) -> dict[str, float]:
    """Per used level, the interval maximising its terms: ``max(floor, sqrt(2 a M / F))``; a
    level with no cost sits at its floor. ``base``: the level every other one copies from (RAM):
    it is checkpointed at least as often as any of them, so its interval is
    ``min(its own optimum, theirs)`` (feasible; jointly optimal unless clamped)."""
    served: dict[str, float] = {}
    for k, f in mix.items():
        served[s.served_by[k]] = served.get(s.served_by[k], 0.0) + f
    out: dict[str, float] = {}
    for j, share in served.items():
        if share <= 0 or j == base:
            continue
        lv = s.levels[j]
        tau = math.sqrt(2.0 * lv.cost_s * mtbf_s / share) if lv.cost_s > 0 else 0.0
        out[j] = max(tau, lv.floor_s)
    if base is not None and base in s.levels:
        lv = s.levels[base]
        share = served.get(base, 0.0)
        own = math.sqrt(2.0 * lv.cost_s * mtbf_s / share) if share > 0 else math.inf
        out[base] = max(lv.floor_s, min([own, *out.values()]))
    return out


def goodput(
    s: Scenario,
    mix: Mapping[str, float],
    mtbf_s: float,
    restart_s: float,
    taus: Mapping[str, float] | None = None,
    base: str | None = None,
) -> dict[str, Any]:
    """Goodput (0..1) of ``s`` and its terms; ``taus`` default: :func:`intervals`."""
    taus = dict(intervals(s, mix, mtbf_s, base) if taus is None else taus)
    checkpoint = sum(s.levels[j].cost_s / t for j, t in taus.items() if t > 0)
    failure = 0.0
    for k, f in mix.items():
        lv = s.levels[s.served_by[k]]
        tau = taus[s.served_by[k]]
        failure += f * (tau / 2.0 + lv.latency_s + lv.restore_s + restart_s) / mtbf_s
    return {
        "goodput": max(0.0, 1.0 - checkpoint - failure),
        "checkpoint_loss": checkpoint,
        "failure_loss": failure,
        "intervals_s": taus,
    }


# -- measured inputs ------------------------------------------------------------------------------


def _median(section: Mapping[str, Any], case: str, key: str = "seconds") -> float:
    return float(section["cases"][case]["stats"][key]["median"])


def _section(latest: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    for title, sec in latest["sections"].items():
        if title.startswith(prefix):
            return sec  # type: ignore[no-any-return]
    raise SystemExit(f"Strata bench: no section {prefix!r} in bench/results/latest.json")


def measured(results: Path = RESULTS, peer_GBps: float | None = None) -> dict[str, Any]:
    """The per-rank figures this model takes from ``make bench`` / ``make scale-data`` runs.
    ``peer_GBps``: replace the measured peer replication rate with this one (an assumption)."""
    latest = json.loads((results / "latest.json").read_text())
    peers = json.loads((results / "peers.json").read_text())
    scale = json.loads((results / "scale-data.json").read_text())
    save = _section(latest, "save W1")
    nbytes = float(save["nbytes"])
    restore = _section(latest, "restore W1")
    pvc = _section(latest, "promote W1 RAM -> PVC")
    gcs_up = _section(latest, "promote W1 (scale")
    gcs_down = _section(latest, "restore W1 (scale")
    gcs_scale = nbytes / float(gcs_up["nbytes"])
    rows = [r for r in peers["per_step"] if r["scheme"] == {"mode": "replicate", "copies": 1}]
    peer_row = max(rows, key=lambda r: r["state_MiB"])
    peer_s_per_byte = peer_row["wall_s_to_protect"] / (peer_row["state_MiB"] * 2**20)
    if peer_GBps is not None:
        peer_s_per_byte = 1.0 / (peer_GBps * 1e9)
    return {
        "state_bytes_per_rank": nbytes,
        "ram_stall_s": _median(save, "strata_save"),
        "ram_commit_s": _median(save, "strata_save", "commit_s"),
        "ram_restore_s": _median(restore, "strata_restore_ram"),
        "pvc_promote_s": _median(pvc, "strata_promote_pvc"),
        "pvc_restore_s": _median(restore, "strata_restore_pvc"),
        "gcs_promote_s": _median(gcs_up, "strata_promote_gcs") * gcs_scale,
        "gcs_restore_s": _median(gcs_down, "strata_fetch_gcs") * gcs_scale,
        "peer_copy_s": peer_s_per_byte * nbytes,
        "interference_fraction": max(0.0, float(latest["ratios"]["interference_fraction"])),
        "single_tier": {
            "torch.save": (_median(save, "torch_save"), 0.0),
            "dcp.save": (_median(save, "dcp_save"), 0.0),
            "dcp.async_save": (
                _median(save, "dcp_async_save"),
                _median(save, "dcp_async_save", "complete_s"),
            ),
        },
        "single_tier_restore_s": _median(restore, "torch_load_disk"),
        "commit_rounds": scale["commit_latency_rounds"],
        "restore_at_w": scale.get("restore", {}),
        "sources": {
            "latest.json": latest.get("generated"),
            "peers.json": peer_row["scheme"] | {"state_MiB": peer_row["state_MiB"]},
            "scale-data.json": scale.get("label") or scale.get("note", "")[:60],
        },
    }


def _nearest(table: Mapping[str, Any], w: int) -> Any:
    keys = sorted(int(k) for k in table)
    return table[str(min(keys, key=lambda k: abs(math.log(k / w))))]


def scenarios(m: Mapping[str, Any], n: int, a: Mapping[str, Any]) -> list[Scenario]:
    """Strata with peers, Strata without peers, and each single-tier method, at N ranks."""
    eps = m["interference_fraction"]
    poll = 0.5  # the sidecar's promotion loop period (strata.sidecar.service poll_seconds)
    rounds = max(max(v) if isinstance(v, list) else v for v in m["commit_rounds"].values())
    commit_wait = rounds * poll
    r = _nearest(m["restore_at_w"], n) if m["restore_at_w"] else {}
    plan_s = float(r.get("plan_seconds", 0.0)) + float(r.get("gathered_parse_seconds_per_rank", 0))
    job_bytes = m["state_bytes_per_rank"] * n
    pvc_all = max(m["pvc_restore_s"], job_bytes / (a["pvc_aggregate_GBps"] * 1e9))
    gcs_all = max(m["gcs_restore_s"], job_bytes / (a["gcs_aggregate_GBps"] * 1e9))
    ram = Level("ram", m["ram_stall_s"], m["ram_commit_s"], m["ram_restore_s"] + plan_s)
    pvc = Level(
        "pvc",
        eps * m["pvc_promote_s"],
        m["ram_commit_s"] + m["pvc_promote_s"] + commit_wait,
        pvc_all + plan_s,
        floor_s=m["pvc_promote_s"],
    )
    gcs = Level(
        "gcs",
        eps * m["gcs_promote_s"],
        m["ram_commit_s"] + m["gcs_promote_s"] + commit_wait,
        gcs_all + plan_s,
        floor_s=m["gcs_promote_s"],
    )
    peer = Level(
        "peers",
        eps * m["peer_copy_s"],
        m["ram_commit_s"] + m["peer_copy_s"],
        m["peer_copy_s"] + plan_s,  # the lost node's ranks fetch from a peer, others from RAM
        floor_s=m["peer_copy_s"],
    )
    out = [
        Scenario(
            "strata + peers",
            {"ram": ram, "peers": peer, "gcs": gcs},
            {"node_local": "ram", "node_loss": "peers", "zone_loss": "gcs"},
        ),
        Scenario(
            "strata, no peers",
            {"ram": ram, "pvc": pvc, "gcs": gcs},
            {"node_local": "ram", "node_loss": "pvc", "zone_loss": "gcs"},
        ),
    ]
    for method, (stall, complete) in m["single_tier"].items():
        # One regional tier (GCS-like, survives a zone) at its Young/Daly interval; its restore
        # is the measured load from disk or the aggregate bandwidth, whichever is longer.
        single = Level(
            method,
            stall,
            max(0.0, complete - stall),
            max(m["single_tier_restore_s"], job_bytes / (a["gcs_aggregate_GBps"] * 1e9)) + plan_s,
            floor_s=max(stall, complete),
        )
        out.append(
            Scenario(
                f"single tier: {method}",
                {method: single},
                dict.fromkeys(a["failure_mix"], method),
            )
        )
    return out


def mtbf_seconds(n: int) -> float:
    """The job's mean time between failures at ``n`` accelerators (Llama 3's per-GPU rate)."""
    per_gpu_s = LLAMA3_DAYS * 86400.0 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS
    return per_gpu_s / n


def model(
    sizes: tuple[int, ...] = (1024, 4096, 16384),
    results: Path = RESULTS,
    assumptions: Mapping[str, Any] = ASSUMPTIONS,
    peer_GBps: float | None = None,
) -> dict[str, Any]:
    m = measured(results, peer_GBps)
    rows = []
    for n in sizes:
        mtbf = mtbf_seconds(n)
        best_single: dict[str, Any] | None = None
        per: list[dict[str, Any]] = []
        for s in scenarios(m, n, assumptions):
            base = "ram" if "ram" in s.levels else None
            g = goodput(s, assumptions["failure_mix"], mtbf, assumptions["restart_s"], base=base)
            row = {"accelerators": n, "mtbf_h": mtbf / 3600.0, "scenario": s.name, **g}
            per.append(row)
            if s.name.startswith("single") and (
                best_single is None or g["goodput"] > best_single["goodput"]
            ):
                best_single = row
        assert best_single is not None
        rows.extend(r for r in per if not r["scenario"].startswith("single"))
        rows.append(best_single | {"scenario": "best " + best_single["scenario"]})
    return {"measured": m, "assumptions": dict(assumptions), "rows": rows}


def _fmt(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| accelerators | job MTBF | scenario | goodput | lost: checkpoints | lost: failures |"
        " intervals (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        taus = ", ".join(f"{k} {v:.0f}" for k, v in r["intervals_s"].items())
        lines.append(
            f"| {r['accelerators']:,} | {r['mtbf_h']:.1f} h | {r['scenario']} |"
            f" {100 * r['goodput']:.2f}% | {100 * r['checkpoint_loss']:.2f}% |"
            f" {100 * r['failure_loss']:.2f}% | {taus} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["scenario"].split(":")[0] for r in rows))
    sizes = sorted({r["accelerators"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name in names:
        ys = [
            100
            * next(
                r["goodput"]
                for r in rows
                if r["accelerators"] == n and r["scenario"].split(":")[0] == name
            )
            for n in sizes
        ]
        label = next(r["scenario"] for r in rows if r["scenario"].split(":")[0] == name)
        ax.plot(sizes, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.set_xlabel("accelerators (Llama 3 failure rate per accelerator)")
    ax.set_ylabel("goodput (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument(
        "--peer-GBps",
        type=float,
        default=None,
        help="peer replication/restore rate per rank instead of the measured one (assumption)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of goodput vs size")
    p.add_argument("--json", type=Path, default=None, help="write the table and inputs")
    args = p.parse_args(argv)
    res = model(
        tuple(int(x) for x in args.sizes.split(",")), args.results, peer_GBps=args.peer_GBps
    )
    m = res["measured"]
    print("measured (per rank, bench/results):")
    for k, v in m.items():
        if k not in ("restore_at_w", "single_tier", "commit_rounds", "sources"):
            print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"  single-tier (stall s, complete s): {m['single_tier']}")
    print(f"  sources: {m['sources']}")
    print(f"assumptions: {res['assumptions']}")
    print(_fmt(res["rows"]))
    if args.plot:
        plot(res["rows"], args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
