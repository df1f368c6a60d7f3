"""``deadpool sim``: a goodput model of a training job at scale (pure functions; the model,
its formulas and every default's source are in docs/simulator.md).

    measured recovery phases (bench recovery, CPU world sizes) ─► per-phase scaling law
        (base/scaling.py) ─► hot swap time lost per failure at W GPUs (+ bandwidth, redone step)
    failures at rate nodes / node MTBF ─► goodput of hot swap, checkpoint/restart and
        in-process restart; Poisson spare count; leave-one-out validation against the file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..base import scaling
from ..base.config import GradStats, values
from ..base.errors import ConfigError
from ..base.vocabulary import PHASE_ORDER
from .sim_measured import load_measured

DEFAULT_GPUS = (512, 4096, 100000)
STRATEGIES = ("hotswap", "checkpoint_restart", "inprocess_restart")
# Llama 3 (arXiv 2407.21783, sec. 3.3.4): 419 unexpected interruptions in 54 days, 16,384 GPUs.
LLAMA3_GPU_MTBF_H = 16384 * 54 * 24 / 419
SHARD_BYTES_PER_PARAM = 12   # fp32 main params + Adam exp_avg + exp_avg_sq (distributed opt.)
MODEL_BYTES_PER_PARAM = 2    # bf16 model params (per TP x PP rank, not sharded over DP)
TOLERANCE = 0.25
LAWS = ("scale", "auto", "counts", "fit")
REPAIR_SOURCE = ("Schroeder and Gibson, 'A large-scale study of failures in high-performance "
                 "computing systems' (DSN 2006; 23,000 failures on 20+ LANL systems): mean "
                 "repair time from under an hour to over a day by system; the upper end, 24 h, "
                 "taken")


# Correlated failures: a share of the failure events takes a whole failure domain at once.
# The domain: an NVLink rack of 18 compute trays of 4 GPUs (NVIDIA GB200 NVL72), which
# shares a power shelf and switch trays. The share: Llama 3's "network switch/cable" events,
# 35 of its 419 unexpected interruptions (arXiv 2407.21783, table 5), all taken as a whole
# domain lost (an upper end: a cable takes one node).
DOMAIN_SOURCE = ("a domain: an NVLink rack, 18 compute trays x 4 GPUs (NVIDIA GB200 NVL72); "
                 "the share of failure events that take a whole domain: Llama 3's network "
                 "switch/cable events, 35 of 419 (arXiv 2407.21783, table 5), all taken as "
                 "a whole domain lost (an upper end)")


UPPER_DOMAIN = (18, 35 / 419)  # (domain nodes, share of the events): DOMAIN_SOURCE


class SimError(ConfigError):
    """Invalid simulator input, detected before anything is computed."""


@dataclass(frozen=True)
class SimConfig:
    """All inputs of the model (echoed under ``assumptions`` in the output)."""

    gpus: Tuple[int, ...] = DEFAULT_GPUS
    gpus_per_node: int = 4
    model_params: float = 70e9
    tp: int = 4
    pp: int = 8
    node_mtbf_hours: Optional[float] = None   # None: Llama 3 per-GPU MTBF / gpus_per_node
    spare_nodes: Optional[int] = None          # given: P(never running out) is reported
    target_probability: float = 0.99
    job_hours: float = 720.0
    # a failed node returns to the pool after this long (0: never, within the job):
    # REPAIR_SOURCE
    repair_hours: float = 24.0
    # correlated failures: a share of the failure events takes a whole domain of this many
    # nodes (a share of 0 or a domain of 1: every failure is one node). Off by default: no
    # source gives the share of whole-rack losses; the output also prints the upper end
    # (UPPER_DOMAIN: DOMAIN_SOURCE) beside the default
    domain_nodes: int = 18
    domain_share: float = 0.0
    link_gbps: float = 200.0                   # inter-node, per GPU
    # the job's --deadpool-grad-stats (base/config.GradStats): "staged", the setting for a
    # job at scale (no group of every rank is made at a recovery), is the model's default;
    # the training default "world" is projected beside it (GRAD_STATS_NOTE)
    grad_stats: str = "staged"
    checkpoint_interval_min: Optional[float] = None   # None: Young's optimum per scale
    checkpoint_write_s: float = 60.0
    checkpoint_load_s: float = 60.0
    restart_cost_s: float = 600.0
    inprocess_restart_s: float = 5.0
    iteration_s: float = 5.0
    mirror_overhead: float = 0.01
    measured_link_gbps: float = 8.0            # bench recovery's transport (CPU, loopback)

    def __post_init__(self):
        if not self.gpus:
            raise SimError("--gpus needs at least one GPU count")
        for name in ("gpus_per_node", "tp", "pp"):
            if getattr(self, name) < 1:
                raise SimError(f"--{name.replace('_', '-')} must be >= 1")
        for g in self.gpus:
            if g < 1 or g % self.gpus_per_node:
                raise SimError(f"{g} GPUs is not a multiple of --gpus-per-node "
                               f"{self.gpus_per_node}")
            if g % (self.tp * self.pp):
                raise SimError(f"layout TP{self.tp} x PP{self.pp} = {self.tp * self.pp} "
                               f"does not divide {g} GPUs")
        positive = ("model_params", "job_hours", "link_gbps", "iteration_s",
                    "measured_link_gbps", "node_mtbf_hours", "checkpoint_interval_min")
        for name in positive:
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise SimError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        for name in ("checkpoint_write_s", "checkpoint_load_s", "restart_cost_s",
                     "inprocess_restart_s", "repair_hours"):
            if not getattr(self, name) >= 0:
                raise SimError(f"--{name.replace('_', '-')} must be >= 0")
        if not 0 < self.target_probability < 1:
            raise SimError(f"--target-probability must be in (0, 1), got "
                           f"{self.target_probability}")
        if not 0 <= self.mirror_overhead < 1:
            raise SimError("--mirror-overhead must be in [0, 1)")
        if self.spare_nodes is not None and self.spare_nodes < 0:
            raise SimError("--spare-nodes must be >= 0")
        if self.grad_stats not in values(GradStats):
            raise SimError(f"--grad-stats must be one of {values(GradStats)}, got "
                           f"{self.grad_stats!r}")
        if self.domain_nodes < 1:
            raise SimError(f"--domain-nodes must be >= 1, got {self.domain_nodes}")
        if not 0 <= self.domain_share <= 1:
            raise SimError(f"--domain-share must be in [0, 1], got {self.domain_share}")

    @property
    def node_mtbf_h(self) -> float:
        return self.node_mtbf_hours or LLAMA3_GPU_MTBF_H / self.gpus_per_node

    def assumptions(self) -> Dict:
        out = dataclasses.asdict(self)
        out["gpus"] = list(self.gpus)
        out["node_mtbf_hours"] = round(self.node_mtbf_h, 1)
        out["node_mtbf_source"] = ("--node-mtbf-hours" if self.node_mtbf_hours else
                                   "Llama 3 per-GPU MTBF (16384 GPUs x 54 days / 419 "
                                   "unexpected interruptions) / gpus_per_node")
        out["repair_source"] = (REPAIR_SOURCE if self.repair_hours == SimConfig.repair_hours
                                else "--repair-hours")
        out["domain_source"] = (DOMAIN_SOURCE if (self.domain_nodes, self.domain_share)
                                == UPPER_DOMAIN else "--domain-nodes, --domain-share")
        return out


def shard_bytes_per_rank(cfg: SimConfig, gpus: int) -> float:
    """Bytes a replacement rank receives: its distributed-optimizer shard plus bf16 params."""
    mp = cfg.tp * cfg.pp
    dp = gpus // mp
    return cfg.model_params * (SHARD_BYTES_PER_PARAM / (mp * dp) + MODEL_BYTES_PER_PARAM / mp)


def _transfer_s(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9)


def fit_phases(runs: List[Dict], cfg: SimConfig) -> Dict[str, scaling.Law]:
    """One law per phase; restore_state's is its latency part (the bytes term removed when
    the runs carry shard_bytes_per_rank)."""
    ws = [r["world_size"] for r in runs]
    laws = {}
    for ph in PHASE_ORDER:
        ys = [r["phases_s"][ph] / r["oversub"] for r in runs]
        if ph == "restore_state":
            ys = [max(0.0, y - _transfer_s(r["shard_bytes"] or 0, cfg.measured_link_gbps))
                  for y, r in zip(ys, runs)]
        laws[ph] = scaling.fit(ws, ys)
    return laws


def phase_laws(measured: Dict, cfg: SimConfig, law: str = "auto") -> Dict:
    """Per phase, its law against W: ``counts`` (sim_counts.py: counted work x unit costs;
    ``auto`` when the file has counts) or ``fit`` (each phase's time fitted directly)."""
    from . import sim_counts

    runs = measured["runs"]
    if law not in LAWS:
        raise SimError(f"--law must be one of {LAWS}, got {law!r}")
    if law == "counts" or (law == "auto" and sim_counts.has_counts(runs)):
        return sim_counts.phase_laws(runs, measured.get("unit_s"))
    return fit_phases(runs, cfg)


def predict_phases(laws: Dict[str, scaling.Law], w: int, nbytes: float,
                   gbps: float) -> Dict[str, float]:
    out = {ph: max(0.0, laws[ph](w)) for ph in PHASE_ORDER}
    out["restore_state"] += _transfer_s(nbytes, gbps)
    return out


def _entry(w: int, predicted: float, measured: float) -> Dict:
    err = (predicted - measured) / measured if measured > 0 else math.inf
    return {"predicted_total_s": round(predicted, 4), "rel_error": round(err, 4),
            "within_25pct": abs(err) <= TOLERANCE}


def validate(runs: List[Dict], cfg: SimConfig) -> List[Dict]:
    """Per measured W: leave-one-out prediction (fit without that W) and in-sample."""
    full = fit_phases(runs, cfg)
    out = []
    for w in sorted({r["world_size"] for r in runs}):
        mine = [r for r in runs if r["world_size"] == w]
        measured = sum(r["total_s"] for r in mine) / len(mine)
        nbytes, k = mine[0]["shard_bytes"] or 0, mine[0]["oversub"]
        loo = fit_phases([r for r in runs if r["world_size"] != w], cfg)
        e = {"world_size": w, "method": "leave-one-out", "oversubscription": round(k, 3),
             **_entry(w, k * sum(predict_phases(loo, w, nbytes, cfg.measured_link_gbps)
                                 .values()), measured),
             "measured_total_s": round(measured, 4)}
        ins = _entry(w, k * sum(predict_phases(full, w, nbytes, cfg.measured_link_gbps)
                                .values()), measured)
        e.update({f"in_sample_{k}": v for k, v in ins.items()})
        out.append(e)
    return out


def checkpoint_interval_s(cfg: SimConfig, system_mtbf_s: float,
                          write_s: Optional[float] = None) -> float:
    """The given interval, or Young's optimum sqrt(2 * write * MTBF) (>= one iteration);
    ``write_s``: another write cost than ``cfg.checkpoint_write_s`` (a local checkpoint)."""
    if cfg.checkpoint_interval_min is not None:
        return cfg.checkpoint_interval_min * 60
    write = cfg.checkpoint_write_s if write_s is None else write_s
    return max(math.sqrt(2 * write * system_mtbf_s), cfg.iteration_s)


def strategies_at(cfg: SimConfig, laws: Dict[str, scaling.Law], gpus: int) -> Dict:
    """Time lost per failure, steady overhead and goodput of each strategy at ``gpus``."""
    nodes = gpus // cfg.gpus_per_node
    rate = nodes / (cfg.node_mtbf_h * 3600)          # failures per second
    tau = checkpoint_interval_s(cfg, 1 / rate)
    ckpt_overhead = cfg.checkpoint_write_s / tau
    phases = predict_phases(laws, gpus, shard_bytes_per_rank(cfg, gpus), cfg.link_gbps)
    redone = cfg.iteration_s / 2
    lost = {"hotswap": sum(phases.values()) + redone,
            "checkpoint_restart": cfg.restart_cost_s + tau / 2,
            "inprocess_restart": cfg.inprocess_restart_s + cfg.checkpoint_load_s + tau / 2}
    overhead = {"hotswap": cfg.mirror_overhead, "checkpoint_restart": ckpt_overhead,
                "inprocess_restart": ckpt_overhead}
    good = {s: max(0.0, (1 - min(1.0, overhead[s])) * (1 - rate * lost[s]))
            for s in STRATEGIES}
    return {"nodes": nodes, "failures_per_day": rate * 86400, "lost": lost, "goodput": good,
            "overhead": overhead, "checkpoint_interval_s": tau,
            "hotswap_breakdown_s": {**phases, "redone_iteration": redone}}


def poisson_cdf(k: int, mu: float) -> float:
    if mu <= 0:
        return 1.0
    return min(1.0, math.fsum(math.exp(-mu + i * math.log(mu) - math.lgamma(i + 1))
                              for i in range(k + 1)))


def spares_needed(mu: float, target: float) -> Tuple[int, float]:
    """Smallest n with P(Poisson(mu) <= n) >= target, and that probability (one pass)."""
    if mu <= 0:
        return 0, 1.0
    n, term = 0, math.exp(-mu)
    p = term
    while p < target and not (term == 0.0 and n > mu):
        n += 1
        term = math.exp(-mu + n * math.log(mu) - math.lgamma(n + 1))
        p += term
    return n, min(1.0, p)


def nodes_lost_cdf(n: int, mu: float, share: float, domain: int) -> float:
    """P(at most ``n`` nodes down at once in the window) when the failure events are
    Poisson(``mu``) and a ``share`` of them takes ``domain`` nodes at once: N = X + domain Y,
    X ~ Poisson(mu (1 - share)) single nodes, Y ~ Poisson(mu share) whole domains."""
    if domain <= 1 or share <= 0:
        return poisson_cdf(n, mu)
    mu_y = mu * share
    return min(1.0, math.fsum(
        math.exp(-mu_y + y * math.log(mu_y) - math.lgamma(y + 1))
        * poisson_cdf(n - domain * y, mu * (1 - share)) for y in range(n // domain + 1)))


def spares_needed_correlated(mu: float, share: float, domain: int, target: float
                             ) -> Tuple[int, float]:
    """Smallest n with P(N <= n) >= target (``nodes_lost_cdf``), and that probability. The
    search runs on the CDF of X tabulated once (O(n) terms) and a bisection (O(n / domain)
    per step); ``nodes_lost_cdf`` itself then settles the boundary. Trying n = 0, 1, ...
    with ``nodes_lost_cdf`` each time is O(n^3 / domain): 580 s for the 720-hour window at
    100,000 GPUs (n about 4,000)."""
    if domain <= 1 or share <= 0:
        return spares_needed(mu, target)
    mu_x, mu_y = mu * (1 - share), mu * share
    cdf_x: List[float] = []
    pmf_y: List[float] = []

    def table(n: int) -> None:
        while len(cdf_x) <= n:
            i = len(cdf_x)
            term = math.exp(-mu_x + i * math.log(mu_x) - math.lgamma(i + 1)) if mu_x > 0 \
                else float(i == 0)
            cdf_x.append((cdf_x[-1] if cdf_x else 0.0) + term)
        while len(pmf_y) <= n // domain:
            y = len(pmf_y)
            pmf_y.append(math.exp(-mu_y + y * math.log(mu_y) - math.lgamma(y + 1)))

    def cdf(n: int) -> float:
        table(n)
        return sum(pmf_y[y] * cdf_x[n - domain * y] for y in range(n // domain + 1))

    lo, hi = 0, 1
    while cdf(hi) < target:
        lo, hi = hi, hi * 2
    while lo < hi:  # the smallest n in [lo, hi] with cdf(n) >= target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if cdf(mid) < target else (lo, mid)
    n = lo
    while nodes_lost_cdf(n, mu, share, domain) < target:
        n += 1
    while n > 0 and nodes_lost_cdf(n - 1, mu, share, domain) >= target:
        n -= 1
    return n, nodes_lost_cdf(n, mu, share, domain)


def spares(cfg: SimConfig) -> Dict:
    window = cfg.repair_hours or cfg.job_hours
    per = {}
    for g in cfg.gpus:
        nodes = g // cfg.gpus_per_node
        mu = nodes * window / cfg.node_mtbf_h
        n, p = spares_needed_correlated(mu, cfg.domain_share, cfg.domain_nodes,
                                        cfg.target_probability)
        n_upper, _ = spares_needed_correlated(mu, UPPER_DOMAIN[1], UPPER_DOMAIN[0],
                                              cfg.target_probability)
        per[str(g)] = {"expected_failures": round(mu, 3), "spare_nodes": n,
                       "probability": round(p, 6),
                       # the spares' GPUs idle while the job trains: a share of the machine
                       "idle_share": round(n / (nodes + n), 6),
                       # the same with UPPER_DOMAIN's correlated failures (DOMAIN_SOURCE)
                       "spare_nodes_upper_domain": n_upper,
                       "idle_share_upper_domain": round(n_upper / (nodes + n_upper), 6)}
        if cfg.spare_nodes is not None:
            per[str(g)]["probability_with_given_spares"] = round(nodes_lost_cdf(
                cfg.spare_nodes, mu, cfg.domain_share, cfg.domain_nodes), 6)
    top = per[str(max(cfg.gpus))]
    return {"model": "Poisson: failure events in the window ~ Poisson(nodes x window / node "
                     "MTBF); a share of them takes a whole domain of nodes at once",
            "domain_nodes": cfg.domain_nodes, "domain_share": round(cfg.domain_share, 6),
            "target_probability": cfg.target_probability, "window_hours": window,
            "window": "repair time" if cfg.repair_hours else "job length",
            "node_mtbf_hours": round(cfg.node_mtbf_h, 1), "gpus": max(cfg.gpus),
            "spare_nodes": top["spare_nodes"], "probability": top["probability"],
            "idle_share": top["idle_share"], "repair_hours": cfg.repair_hours or None,
            "given_spare_nodes": cfg.spare_nodes, "per_scale": per}


def default_law(measured_path) -> str:
    """``deadpool sim``'s law when none is given: "scale" where the measured runs carry
    counts, else "auto" (each phase's time fitted)."""
    from . import sim_counts

    try:
        return "scale" if sim_counts.has_counts(load_measured(measured_path)["runs"]) \
            else "auto"
    except Exception:  # noqa: BLE001 - simulate() names what is wrong with the file
        return "auto"


def simulate(cfg: SimConfig, measured_path, law: str = "auto",
             units: Optional[str] = None, log=print) -> Dict:
    """The whole model: the JSON ``deadpool sim --json`` writes. ``law``: "scale" (the
    default of ``deadpool sim``: sim_scale.py), else phase_laws' choice."""
    from . import sim_counts

    measured = load_measured(measured_path, units)
    if law == "scale":
        return _simulate_at_scale(cfg, measured, measured_path, log)
    laws = phase_laws(measured, cfg, law)
    by_counts = isinstance(next(iter(laws.values())), sim_counts.CountLaw)
    at = {str(g): strategies_at(cfg, laws, g) for g in cfg.gpus}
    law_json = {ph: law.to_json() for ph, law in laws.items()}
    _bytes_term(law_json, measured)
    return {
        **_common(cfg, at, law_json, measured, measured_path),
        "law": "counts" if by_counts else "fit",
        "unit_costs": ("timed one by one (deadpool bench units)" if measured["unit_s"]
                       else "fitted to the phase times") if by_counts else None,
        "validation": sim_counts.validate(measured["runs"], TOLERANCE, measured["unit_s"])
        if by_counts
        else validate(measured["runs"], cfg),
    }


def _simulate_at_scale(cfg: SimConfig, measured: Dict, measured_path, log) -> Dict:
    """The law at scale (sim_scale.py): the plans of cfg's layout at each GPU count, the
    count law fitted up to sim_scale.FIT_MAX_W, the unit costs at scale."""
    from . import sim_counts, sim_scale

    runs = measured["runs"]
    if not sim_counts.has_counts(runs):
        raise SimError(f"{measured_path}: the law at scale needs runs measured with `deadpool "
                       "bench recovery --counts` (or pass --law fit)")
    unit_list = sim_scale.units()
    plans = sim_scale.plans_for(cfg.gpus, cfg.tp, cfg.pp, cfg.gpus_per_node, log=log,
                                grad_stats=cfg.grad_stats)
    laws = sim_scale.phase_laws(runs, plans, unit_list)
    at = {str(g): strategies_at(cfg, laws, g) for g in cfg.gpus}
    other = next(v for v in values(GradStats) if v != cfg.grad_stats)
    other_plans = sim_scale.plans_for(cfg.gpus, cfg.tp, cfg.pp, cfg.gpus_per_node, log=log,
                                      grad_stats=other)
    other_laws = sim_scale.phase_laws(runs, other_plans, unit_list)
    law_json = {ph: law.to_json() for ph, law in laws.items()}
    _bytes_term(law_json, measured)
    return {
        **_common(cfg, at, law_json, measured, measured_path),
        "law": "scale",
        "unit_costs": "gloo: fitted to the phase times of the runs up to W = "
                      f"{sim_scale.FIT_MAX_W}; at scale: units_at_scale",
        "units_at_scale": [dataclasses.asdict(u) for u in unit_list],
        "behaviour_at_scale": [dataclasses.asdict(b) for b in sim_scale.BEHAVIOUR],
        "plans": {str(g): {"megatron_core": p.get("megatron_core"),
                           "busiest_survivor_groups": p["busiest_survivor"]["groups"],
                           "rebuilt_members_total": p["rebuilt_members_total"],
                           "groups_with_a_dead_rank": p["groups_with_a_dead_rank"]}
                  for g, p in plans.items()},
        "steady_store_utilization": {str(g): round(sim_scale.steady_utilization(
            g, {u.name: u.value for u in unit_list}), 4) for g in cfg.gpus},
        "grad_stats_other": {"grad_stats": other, "lost_per_failure_s": {
            str(g): round(strategies_at(cfg, other_laws, g)["lost"]["hotswap"], 6)
            for g in cfg.gpus}},
        "validation": sim_counts.validate(sim_scale.fit_runs(runs), TOLERANCE),
        "validation_outside_fit": sim_scale.outside_fit(runs, within=TOLERANCE),
    }


def _bytes_term(law_json: Dict, measured: Dict) -> None:
    law_json["restore_state"]["bytes_term"] = (
        "+ shard_bytes_per_rank / link bandwidth (latency part fitted"
        + (" after removing bytes / measured_link_gbps)" if any(
            r["shard_bytes"] for r in measured["runs"]) else "; no bytes in the measured file)"))


def _common(cfg: SimConfig, at: Dict, law_json: Dict, measured: Dict, measured_path) -> Dict:
    def shape(key):
        return {s: {g: round(v[key][s], 6) for g, v in at.items()} for s in STRATEGIES}

    return {
        "assumptions": cfg.assumptions(), "scaling_law": law_json,
        "goodput": shape("goodput"), "lost_per_failure_s": shape("lost"),
        "steady_overhead": shape("overhead"),
        "per_scale": {g: {"nodes": v["nodes"], "failures_per_day": round(v["failures_per_day"], 3),
                          "checkpoint_interval_min": round(v["checkpoint_interval_s"] / 60, 2),
                          "shard_bytes_per_rank": int(shard_bytes_per_rank(cfg, int(g))),
                          "hotswap_breakdown_s": {k: round(x, 4) for k, x in
                                                  v["hotswap_breakdown_s"].items()}}
                      for g, v in at.items()},
        "spares": spares(cfg),
        "validation_method": "leave-one-out (each measured W predicted from a fit on the "
                             "other world sizes); in_sample_* fields: fit on all",
        "measured_file": str(measured_path), "measured_placeholder": measured["placeholder"],
        **({"measured_phases_missing": measured["phases_missing"]}
           if measured["phases_missing"] else {}),
    }
