"""``deadpool sim --peers FILE``: the goodput projection, calibrated by ``deadpool bench
peers`` (issue 36; docs/peers.md, docs/simulator.md). Pure functions.

Each peer's time lost per failure is built from the pieces its restarts were measured to
spend on the benchmark's job (``peer_log.restart_pieces``: detection, process start and
imports; model build; data iterators) plus the costs that grow with the model and the
world, which a 2-core CPU machine cannot measure and which are therefore stated
assumptions (``PeerScale``, each with its source). DeadPool's comes from the simulator's
hot-swap model (the measured recovery phases' scaling laws, ``sim.strategies_at``).

    relaunch     requeue + start + init(W) + build + load(persistent) + data + tau/2
    nvrx         start + init(W) + build + load(persistent) + data + tau/2   (hot spare)
    nvrx-local   start + init(W) + build + load(local) + data + tau_local/2
    deadpool     the hot swap's phases at W + half an iteration

tau is Young's interval sqrt(2 x write x MTBF_job) for each system's own write cost; the
steady overhead of a checkpointing system is write / tau, DeadPool's the mirror's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from ..base.errors import DeadpoolError
from . import sim, sim_measured

CHECKPOINTING = ("relaunch", "nvrx", "nvrx-local")
SYSTEMS = ("deadpool",) + CHECKPOINTING


@dataclass(frozen=True)
class PeerScale:
    """The GPU-scale costs not measured here. Every value is an assumption; ``SOURCES``
    says where each comes from."""

    requeue_s: float = 300.0        # relaunch only
    init_s: float = 60.0            # a fresh job's torch.distributed + NCCL init at scale
    local_gbps: float = 16.0        # node-local NVMe per GPU (Gb/s), write and read
    replication: int = 2            # nvrx-local copies of each shard (its --replication)


SOURCES = {
    "requeue_s": "assumption: a scheduler requeue and a fresh allocation of a large job "
                 "(Slurm --requeue), taken as 5 minutes; the simulator's restart_cost_s "
                 "(600 s) is this plus start, init and load",
    "init_s": "assumption: torch.distributed rendezvous and NCCL communicator creation of a "
              "freshly started job of thousands of GPUs, taken as 1 minute; the benchmark's "
              "own init (8 CPU processes) is in the measured pieces and replaced by this",
    "local_gbps": "assumption: a node's NVMe array (~8 GB/s) shared by 4 GPUs = 16 Gb/s each",
    "replication": "the benchmark's NVRx local-checkpoint flags (--replication-factor 2)",
    "checkpoint_write_s": "the simulator's (docs/simulator.md): a ~1 TB persistent checkpoint",
    "checkpoint_load_s": "the simulator's (docs/simulator.md)",
}


def load_pieces(path) -> Dict[str, dict]:
    """Per system, the medians ``bench peers`` measured: restart pieces, redone
    iterations, step and save seconds, recovery seconds. DeadpoolError if unusable."""
    p = Path(path)
    if not p.exists():
        raise DeadpoolError(f"peers file {p} not found: run `deadpool bench peers` (it "
                            f"writes peers.json under --work) and pass it with --peers")
    try:
        summary = json.loads(p.read_text())["summary"]
        out = {}
        for system, s in summary.items():
            out[system] = {"pieces": dict(s.get("pieces") or {}),
                           **{k: s[k]["median"] for k in ("recovery_s", "redone",
                                                          "iteration_s", "save_s", "lost_s")}}
    except (ValueError, KeyError, TypeError) as exc:
        raise DeadpoolError(f"{p}: not a bench peers result ({exc!r})") from None
    missing = [s for s in CHECKPOINTING if s in out and not out[s]["pieces"]]
    if missing:
        raise DeadpoolError(f"{p}: no restart pieces for {missing}: measured before "
                            f"pieces were recorded; rerun `bench peers --reparse`")
    return out


def _piece(m: dict, key: str) -> float:
    return float(m["pieces"].get(key) or 0.0)


def lost_per_failure(system: str, m: dict, cfg: sim.SimConfig, scale: PeerScale,
                     gpus: int, mtbf_s: float) -> dict:
    """One checkpointing system at ``gpus``: seconds lost per failure by piece, the
    interval and the steady overhead."""
    if system == "nvrx-local":
        nbytes = sim.shard_bytes_per_rank(cfg, gpus)
        write = nbytes * scale.replication * 8 / (scale.local_gbps * 1e9)
        load = nbytes * 8 / (scale.local_gbps * 1e9)
    else:
        write, load = cfg.checkpoint_write_s, cfg.checkpoint_load_s
    tau = sim.checkpoint_interval_s(cfg, mtbf_s, write)
    parts = {"requeue_s": scale.requeue_s if system == "relaunch" else 0.0,
             "start_measured_s": _piece(m, "other_s"), "init_s": scale.init_s,
             "build_measured_s": _piece(m, "build_s"), "load_s": load,
             "data_measured_s": _piece(m, "data_s"), "redone_s": tau / 2}
    return {"parts": parts, "lost_s": sum(parts.values()), "interval_s": tau,
            "overhead": write / tau}


def project(cfg: sim.SimConfig, measured_path, peers: Dict[str, dict],
            scale: PeerScale = PeerScale()) -> dict:
    """Per scale, per system: lost per failure, steady overhead, goodput; the ratio of each
    system's loss to DeadPool's."""
    laws = sim.phase_laws(sim_measured.load_measured(measured_path), cfg)
    out = {}
    for g in cfg.gpus:
        hot = sim.strategies_at(cfg, laws, g)
        rate = hot["nodes"] / (cfg.node_mtbf_h * 3600)
        row = {"deadpool": {"lost_s": hot["lost"]["hotswap"],
                            "overhead": hot["overhead"]["hotswap"],
                            "parts": hot["hotswap_breakdown_s"]}}
        for system in CHECKPOINTING:
            if system in peers:
                row[system] = lost_per_failure(system, peers[system], cfg, scale, g, 1 / rate)
        for v in row.values():
            v["goodput"] = max(0.0, (1 - min(1.0, v["overhead"])) * (1 - rate * v["lost_s"]))
            v["lost_ratio_to_deadpool"] = v["lost_s"] / row["deadpool"]["lost_s"]
        out[str(g)] = {"failures_per_day": rate * 86400, "systems": row}
    return {"per_scale": out, "measured": peers,
            "assumptions": {**dataclasses.asdict(scale), "sources": SOURCES,
                            "checkpoint_write_s": cfg.checkpoint_write_s,
                            "checkpoint_load_s": cfg.checkpoint_load_s,
                            "iteration_s": cfg.iteration_s, "model_params": cfg.model_params,
                            "node_mtbf_hours": round(cfg.node_mtbf_h, 1)}}


def format_table(result: dict) -> list:
    lines = ["goodput (lost s per failure, x DeadPool's) per system, measured restart "
             "pieces + stated GPU-scale assumptions (docs/peers.md)",
             f"{'GPUs':>7} {'fail/day':>9}  " + "  ".join(f"{s:>26}" for s in SYSTEMS)]
    for g, v in result["per_scale"].items():
        cells = []
        for s in SYSTEMS:
            x = v["systems"].get(s)
            cells.append(f"{'-':>26}" if x is None else
                         f"{x['goodput']:7.4f} ({x['lost_s']:7.1f} s, "
                         f"x{x['lost_ratio_to_deadpool']:5.1f})".rjust(26))
        lines.append(f"{g:>7} {v['failures_per_day']:9.2f}  " + "  ".join(cells))
    return lines
