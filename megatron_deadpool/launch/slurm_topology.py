"""Each node's failure domain from Slurm's topology: the leaf switch it hangs off (issue 59).

``scontrol show topology`` (with ``TopologyPlugin=topology/tree``) prints one line per
switch; the leaves (``Level=0``) name their nodes as a hostlist::

    SwitchName=s0 Level=0 LinkSpeed=1 Nodes=nid[001-004]
    SwitchName=s1 Level=0 LinkSpeed=1 Nodes=nid[005-008]
    SwitchName=top Level=1 LinkSpeed=1 Switches=s[0-1]

A node's domain is its leaf switch: a leaf switch lost takes its nodes down at once. The
batch script (scripts/slurm_common.sh, ``DEADPOOL_FAILURE_DOMAINS=slurm``) writes the job's
nodes, in node-rank order, as JSON ``{node rank: switch}`` and passes
``--deadpool-failure-domains file:PATH`` (mirror/placement.py): every process then reads the
same map. A node under no leaf is a domain of its own.

    python -m megatron_deadpool.launch.slurm_topology --nodes "h0 h1 ..." --out F
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence


def leaves(topology: str) -> Dict[str, str]:
    """{leaf switch: its Nodes= hostlist} from ``scontrol show topology``'s lines."""
    out = {}
    for line in topology.splitlines():
        fields = dict(x.split("=", 1) for x in line.split() if "=" in x)
        if fields.get("SwitchName") and fields.get("Nodes") and fields.get("Level", "0") == "0":
            out[fields["SwitchName"]] = fields["Nodes"]
    return out


def domain_map(order: Sequence[str], switch_nodes: Mapping[str, Sequence[str]]
               ) -> Dict[int, str]:
    """{node rank: leaf switch} for the job's nodes ``order`` (node rank = position)."""
    switch_of = {host: sw for sw, hosts in switch_nodes.items() for host in hosts}
    return {i: switch_of[h] for i, h in enumerate(order) if h in switch_of}


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def from_slurm(order: Sequence[str], run: Optional[Callable[..., str]] = None
               ) -> Dict[int, str]:
    """The job's map from the running Slurm: its topology, each leaf's hostlist expanded by
    ``scontrol show hostnames`` (``run``: scontrol with these arguments, its output)."""
    run = run or _scontrol
    expanded = {sw: run("show", "hostnames", hosts).split()
                for sw, hosts in leaves(run("show", "topology")).items()}
    return domain_map(order, expanded)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_deadpool.launch.slurm_topology",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", required=True, help="the job's hostnames in node-rank order")
    ap.add_argument("--out", required=True, help="where to write {node rank: switch}")
    args = ap.parse_args(argv)
    order = args.nodes.split()
    try:
        got = from_slurm(order)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"deadpool: error: scontrol show topology failed: {exc}", file=sys.stderr)
        return 2
    if len(set(got.values())) < 2:
        print("deadpool: error: Slurm's topology puts this job's nodes under "
              f"{len(set(got.values()))} leaf switch(es) (TopologyPlugin=topology/tree and "
              "topology.conf name the switches): no domains to place buddies across",
              file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump({str(k): v for k, v in got.items()}, f)
    alone = [h for i, h in enumerate(order) if i not in got]
    print(f"deadpool: failure domains from Slurm's topology: {len(order)} node(s) under "
          f"{len(set(got.values()))} leaf switch(es)"
          + (f"; {len(alone)} under none (each its own domain): {' '.join(alone)}"
             if alone else "") + f"; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
