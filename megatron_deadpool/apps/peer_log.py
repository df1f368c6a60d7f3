"""The peer benchmark's log and what is read from it (``deadpool bench peers``,
docs/peers.md). Pure text in, numbers out: no processes, no clocks.

The benchmark writes one log per run. Each line is ``<seconds since the launch> <text>``:
every line any process of the job printed, stamped on arrival, and the benchmark's own
markers, ``#peers <event> key=value ...`` (``kill``: the injector fired; ``start``: a
(re)launch of the job; ``exit``: the job ended). Megatron-LM logs a finished iteration as
``iteration   N/  T | ...`` (``--log-interval 1``) and a finished save as
``successfully saved checkpoint from iteration   N ...`` (a local checkpoint: ``... saved
local checkpoint ...``, from every rank).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
# persistent saves (Megatron-LM's rank 0) and local ones (NVRx's manager, every rank)
SAVED = re.compile(r"successfully saved (?:local )?checkpoint from iteration\s+(\d+)", re.I)
MARKER = re.compile(r"#peers (\w+)((?: \w+=\S*)*)\s*$")
# the start-up a restart pays, as Megatron-LM's timers print it (max over ranks, ms; under
# `deadpool launch` behind its "[nN rR]" prefix) and its
# "time to initialize megatron (seconds): X" (distributed init, rendezvous included)
TIMER = re.compile(r"^(?:\[n\d+ r\d+\])?\s*(load-checkpoint|model-and-optimizer-setup|"
                   r"train/valid/test-data-iterators-setup)\s*\.+:\s*\(([\d.]+),\s*([\d.]+)\)")
INIT = re.compile(r"time to initialize megatron \(seconds\):\s*([\d.]+)")
PIECES = ("other_s", "init_s", "build_s", "load_s", "data_s")  # restart_pieces' keys
PIECE = {"load-checkpoint": "load_s", "model-and-optimizer-setup": "setup_s",
         "train/valid/test-data-iterators-setup": "data_s"}


def stamp(t: float, text: str) -> str:
    return f"{t:.3f} {text.rstrip()}"


def marker(t: float, event: str, **fields) -> str:
    return stamp(t, " ".join([f"#peers {event}"] + [f"{k}={v}" for k, v in fields.items()]))


def iteration_of(text: str) -> Optional[int]:
    """The finished iteration a Megatron-LM log line reports, or None."""
    m = ITERATION.search(text)
    return int(m.group(1)) if m else None


@dataclass
class RunLog:
    iterations: List[Tuple[float, int]] = field(default_factory=list)  # (t, finished iter)
    saves: List[Tuple[float, int]] = field(default_factory=list)       # (t, saved iter)
    markers: List[Tuple[float, str, Dict[str, str]]] = field(default_factory=list)
    seen: List[int] = field(default_factory=list)  # per marker: iteration lines before it
    timers: List[Tuple[float, str, float]] = field(default_factory=list)  # (t, piece, s)

    def first(self, event: str) -> Optional[Tuple[float, Dict[str, str]]]:
        return next(((t, f) for t, e, f in self.markers if e == event), None)

    def count(self, event: str) -> int:
        return sum(1 for _, e, _ in self.markers if e == event)


def parse(text: str) -> RunLog:
    out, last_save = RunLog(), None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        try:
            t = float(head)
        except ValueError:
            continue
        m = MARKER.search(rest)
        if m and rest.startswith("#peers "):
            fields = dict(kv.split("=", 1) for kv in m.group(2).split())
            out.markers.append((t, m.group(1), fields))
            out.seen.append(len(out.iterations))
            continue
        it = iteration_of(rest)
        if it is not None:
            out.iterations.append((t, it))
            continue
        piece = _piece(rest)
        if piece is not None:
            out.timers.append((t, *piece))
            continue
        s = SAVED.search(rest)
        if s and (int(s.group(1)), len(out.iterations)) != last_save:
            out.saves.append((t, int(s.group(1))))  # once per save, not once per rank
            last_save = (int(s.group(1)), len(out.iterations))
    return out


def _piece(text: str) -> Optional[Tuple[str, float]]:
    m = TIMER.search(text)
    if m:
        return PIECE[m.group(1)], float(m.group(3)) / 1000.0
    m = INIT.search(text)
    return ("init_s", float(m.group(1))) if m else None


def restart_pieces(log: RunLog, t_kill: float, t_first: float, step: Optional[float]
                   ) -> dict:
    """What the restart after the kill spent, from the first of each Megatron-LM start-up
    print between the kill and the first step after it: ``init_s`` (Megatron's
    initialization: distributed init and rendezvous), ``load_s`` (the checkpoint load),
    ``build_s`` (model and optimizer built, the load taken out), ``data_s`` (data
    iterators) and ``other_s``, the rest of the span less one step: failure detection,
    process start, imports. A system that restarts nothing (a hot swap) has only
    ``other_s``."""
    got: Dict[str, float] = {}
    for t, name, sec in log.timers:
        if t_kill < t <= t_first and name not in got:
            got[name] = sec
    out = {"init_s": got.get("init_s", 0.0), "load_s": got.get("load_s", 0.0),
           "build_s": max(0.0, got.get("setup_s", 0.0) - got.get("load_s", 0.0)),
           "data_s": got.get("data_s", 0.0)}
    out["other_s"] = max(0.0, t_first - t_kill - sum(out.values()) - (step or 0.0))
    return out


def step_times(log: RunLog, skip: int = 2) -> Tuple[List[float], Dict[int, float]]:
    """Seconds between consecutive finished iterations of one uninterrupted run: the plain
    steps (the first ``skip`` iterations left out: warm-up) and, separately, the steps
    that follow a save (their time includes the save), keyed by the saved iteration."""
    saved = {it for _, it in log.saves}
    plain, after_save = [], {}
    pairs = list(zip(log.iterations, log.iterations[1:]))
    for (t0, i0), (t1, i1) in pairs:
        if i1 != i0 + 1 or i0 < skip:
            continue
        if i0 in saved:
            after_save[i0] = t1 - t0
        else:
            plain.append(t1 - t0)
    return plain, after_save


def span(log: RunLog, train_iters: int) -> Optional[float]:
    """Seconds from the end of iteration 1 to the end of the final iteration (its last
    log line): the training the run did, restarts included. The start-up before the first
    iteration and the final save are the same work in every run of a system and, on a
    shared machine, mostly noise, so they are left out."""
    first = next((t for t, it in log.iterations if it == 1), None)
    done = [t for t, it in log.iterations if it == train_iters]
    return done[-1] - first if done and first is not None else None


def cpu_per_iteration(log: RunLog) -> Dict[str, float]:
    """CPU seconds per iteration of the whole job, by role and in ``total``, between the
    first two ``cpu`` markers (the benchmark's CpuProbe: cumulative CPU seconds of every
    process of the job when an iteration was logged); empty without two markers."""
    marks = [f for _, e, f in log.markers if e == "cpu"][:2]
    if len(marks) < 2 or int(marks[1]["iter"]) <= int(marks[0]["iter"]):
        return {}
    n = int(marks[1]["iter"]) - int(marks[0]["iter"])
    out = {k: (float(marks[1][k]) - float(v)) / n for k, v in marks[0].items()
           if k != "iter" and k in marks[1]}
    out["total"] = sum(out.values())
    return out


def free_run_costs(log: RunLog, train_iters: int) -> dict:
    """A failure-free run: its step time, the cost of one save, its end time, and its CPU
    seconds per iteration (``cpu_s``: the whole job's, saves included; ``cpu_by_role``)."""
    plain, after_save = step_times(log)
    step = statistics.median(plain) if plain else None
    costs = [dt - step for it, dt in after_save.items() if step is not None
             and it < train_iters]
    cpu = cpu_per_iteration(log)
    return {"iteration_s": step, "save_s": statistics.median(costs) if costs else None,
            "saves": len(log.saves), "free_span_s": span(log, train_iters),
            "cpu_s": cpu.get("total"), "cpu_by_role": cpu}


def failure_run(log: RunLog, free: RunLog, train_iters: int) -> dict:
    """One run with a kill, against the same system's failure-free run."""
    kill = log.first("kill")
    end, free_end = span(log, train_iters), span(free, train_iters)
    out = {"killed": kill is not None, "kill_iteration": None, "recovery_s": None,
           "redone": None, "lost_s": None, "span_s": end,
           "relaunches": max(0, log.count("start") - 1)}
    if end is not None and free_end is not None:
        out["lost_s"] = end - free_end
    if kill is None:
        return out
    t_kill = kill[0]
    out["kill_iteration"] = int(kill[1].get("iter", -1))
    n = log.seen[next(i for i, m in enumerate(log.markers) if m[1] == "kill")]
    before = [it for _, it in log.iterations[:n]]  # in the order the lines arrived
    after = log.iterations[n:]
    if after:
        t1, first = after[0]
        out["recovery_s"] = t1 - t_kill
        out["first_after"] = first
        out["redone"] = max(0, (max(before) if before else 0) - first + 1)
        out["pieces"] = restart_pieces(log, t_kill, t1, free_run_costs(free, train_iters)
                                       ["iteration_s"])
    return out


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval that minimises the expected time lost,
    sqrt(2 * C * MTBF) for save cost C and mean time between failures MTBF."""
    return (2.0 * save_s * mtbf_s) ** 0.5


def summarize(values: List[Optional[float]]) -> dict:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
