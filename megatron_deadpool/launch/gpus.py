"""Which GPU each worker process uses (``deadpool launch --device cuda``), and the
shared-GPU mode (``--share-gpu``): more processes than GPUs on a machine, for testing the
NCCL path of a whole job on one GPU. NVIDIA does not support this layout; it is a test
layout, not a production one.

Plain NCCL refuses two ranks on one GPU ("Duplicate GPU detected": it compares a host hash
and the GPU's bus id). NCCL hashes ``NCCL_HOSTID``, when set, into that host hash, so each
process of a shared-GPU job gets a host id of its own before its first NCCL call: every
process is then its own host, and ranks connect through the socket transport on loopback.
:data:`SHARED_GPU_NCCL` is the one list of what the mode sets; the launcher prints it once
and writes it in the summary.

Placement: a real node (``--node-rank``) places its processes by local rank; locally
simulated nodes share this machine's GPUs, so a process is placed by its slot on the
machine (node x procs-per-node + local rank). Whenever a process is pinned to one GPU
(shared mode or simulated nodes) it sees only that GPU (``CUDA_VISIBLE_DEVICES``) as
device 0 (``LOCAL_RANK=0``), which is what Megatron-LM's ``torch.cuda.set_device(
args.local_rank)`` and the reference trainer then select.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from ..base.errors import ConfigError
from ..base.worker_env import UNBOUND, physical_id, promoted_gpu  # noqa: F401 (placement's API)

# What every process of a shared-GPU job gets (besides its own NCCL_HOSTID). The transport
# settings make distinct "hosts" on one machine talk through sockets on loopback; ALGO and
# PROTO fix the algorithm that NCCL's cost model could otherwise pick differently.
SHARED_GPU_NCCL: Dict[str, str] = {
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
}
HOSTID_VAR = "NCCL_HOSTID"
MODE_FLAG = "--share-gpu"


def visible_gpus(env=os.environ) -> List[str]:
    """This machine's usable GPUs, as ``CUDA_VISIBLE_DEVICES`` entries: that variable's list
    when it is set, else ``0..n-1`` for the n devices torch counts (no CUDA context is made
    here: the count comes from NVML where torch can use it)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [x.strip() for x in listed.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 -- a broken driver counts as no GPU: refused below
        n = 0
    return [str(i) for i in range(n)]


def check(procs_here: int, share: bool, gpus: List[str]) -> None:
    """Refuse, in one line each, a CUDA launch this machine cannot place."""
    if not gpus:
        raise ConfigError("--device cuda: no GPU is visible on this machine "
                          "(CUDA_VISIBLE_DEVICES or the driver); use --device cpu")
    if procs_here > len(gpus) and not share:
        raise ConfigError(f"--device cuda: {procs_here} processes on this machine and "
                          f"{len(gpus)} GPU(s); {MODE_FLAG} runs several processes on each "
                          "GPU (a test layout, not a production one)")


def host_id(node: int, lid: int) -> str:
    """A process's own NCCL host id. Process ids (lids) are never reused in a job: spares and
    restarted processes get new ones, so no two live processes share a host id."""
    return f"deadpool-n{node}-p{lid}"


def process_env(gpus: List[str], slot: int, node: int, lid: int, share: bool,
                pin: bool) -> Dict[str, str]:
    """The variables one worker process gets for its GPU. ``slot``: its place on this
    machine; ``pin``: give it one GPU (shared mode or simulated nodes), else leave the
    placement to its local rank as a real node does."""
    out: Dict[str, str] = {}
    if pin or share:
        out.update(CUDA_VISIBLE_DEVICES=gpus[slot % len(gpus)], LOCAL_RANK="0")
    if share:
        out.update(SHARED_GPU_NCCL)
        out[HOSTID_VAR] = host_id(node, lid)
    return out


def standby_env(gpus: List[str], node: int, procs_per_node: int, pin: bool
                ) -> Dict[str, str]:
    """A warm standby's variables on a GPU node (``--deadpool-local-standby`` with
    ``--device cuda``, not shared): no GPU bound (``LOCAL_RANK`` UNBOUND), and every GPU of
    its node visible, since it may take any of them. A real node's GPUs are all visible
    already; a simulated node's are its processes' slots (``pin``)."""
    out = {"LOCAL_RANK": UNBOUND}
    if pin:
        mine = [gpus[(node * procs_per_node + j) % len(gpus)] for j in range(procs_per_node)]
        out["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(mine))
    return out


def describe(share: bool) -> Optional[dict]:
    """The summary's and the start-up line's record of the mode (None when off)."""
    if not share:
        return None
    return {"nccl_env": dict(SHARED_GPU_NCCL),
            "per_process": {HOSTID_VAR: "deadpool-n<node>-p<process id>",
                            "CUDA_VISIBLE_DEVICES": "one GPU, by the process's slot",
                            "LOCAL_RANK": "0"},
            "note": "a test layout: several NCCL ranks on one GPU, not a production one"}
