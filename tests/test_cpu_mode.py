"""CPU mode: every stand-in is exercised in a fresh process (the mode is process-global)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch
    import megatron_deadpool  # importing the package must not switch anything on
    assert torch.cuda.current_device.__module__ != "megatron_deadpool.adapters.cpu_mode"
    from megatron_deadpool.adapters import cpu_mode
    assert not cpu_mode.is_enabled()
    cpu_mode.enable()
    assert cpu_mode.is_enabled()
    c = torch.cuda
    assert c.is_available() and c.device_count() == 1
    assert c.current_device() == torch.device("cpu")
    x = torch.empty(3, device="cuda"); assert x.device.type == "cpu"
    y = torch.zeros(2, device=torch.device("cuda", 0)); assert y.device.type == "cpu"
    z = torch.ones(2, device=c.current_device()); assert z.device.type == "cpu"
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    s = c.Stream(); e = c.Event(); e.record(); s.wait_event(e); c.current_stream().wait_stream(s)
    with c.stream(s):
        pass
    c.synchronize(); c.empty_cache()
    assert c.memory_allocated() == 0 and c.max_memory_allocated() == 0
    assert c.get_device_properties(0).major == 8 and c.get_device_capability() == (8, 0)
    # CUDA RNG == the CPU default generator
    c.manual_seed(5); a = torch.rand(3); c.manual_seed(5); b = torch.rand(3)
    assert torch.equal(a, b)
    st = c.get_rng_state(); r1 = torch.rand(2); c.set_rng_state(st); r2 = torch.rand(2)
    assert torch.equal(r1, r2)
    from megatron.core.tensor_parallel import random as mr
    st = mr._get_cuda_rng_state(); r1 = torch.rand(2); mr._set_cuda_rng_state(st)
    assert torch.equal(r1, torch.rand(2))
    tr = mr.get_cuda_rng_tracker(); tr.reset(); tr.add("model-parallel-rng", 77)
    before = torch.get_rng_state()
    with tr.fork():
        inside = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
    g = torch.Generator().manual_seed(77); assert torch.equal(inside, torch.rand(2, generator=g))
    print("CPU-MODE-OK")
""")


def test_every_stand_in():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "CPU-MODE-OK" in p.stdout, p.stdout + p.stderr


# Two gloo ranks: rank 0 sends a stage output through megatron-core's overlapped p2p path
# (the interleaved schedule's), then frees it as the schedule does before waiting on the send;
# rank 1 posts its receive only after that, so the send reads the memory then.
P2P = textwrap.dedent("""
    import os
    import sys
    import torch
    import torch.distributed as dist
    from megatron_deadpool.adapters import cpu_mode
    cpu_mode.enable()
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
    rank, store = int(sys.argv[1]), dist.FileStore(sys.argv[2], 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    sent = torch.arange(4096, dtype=torch.float32).to(torch.bfloat16).view(32, 2, 64)
    none = dict(tensor_send_prev=None, tensor_recv_next=None, group=dist.group.WORLD,
                prev_pipeline_rank=1 - rank, next_pipeline_rank=1 - rank)
    if rank == 0:
        out = sent.clone().requires_grad_()
        reqs = p2p._p2p_ops(tensor_send_next=out, tensor_recv_prev=None, **none)
        deallocate_output_tensor(out, True)
        later = [torch.full_like(sent, float("nan")) for _ in range(8)]  # reuse freed memory
        store.set("freed", "1")
        reqs["send_next"].wait()
    else:
        store.wait(["freed"])
        got = torch.empty_like(sent)
        p2p._p2p_ops(tensor_send_next=None, tensor_recv_prev=got, **none)["recv_prev"].wait()
        print("RECEIVED-AS-SENT" if torch.equal(got, sent) else f"CORRUPT {got.flatten()[:4]}")
    sys.stdout.flush()
    os._exit(0)  # (gloo's teardown waits some 10 s for the peer)
""")


def test_overlapped_p2p_send_survives_the_output_deallocation(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", P2P]
    store = str(tmp_path / "store")
    sender = subprocess.Popen(args + ["0", store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    recv = subprocess.run(args + ["1", store], env=env, capture_output=True, text=True,
                          timeout=300)
    out, err = sender.communicate(timeout=60)
    assert sender.returncode == 0, out + err
    assert recv.returncode == 0 and "RECEIVED-AS-SENT" in recv.stdout, recv.stdout + recv.stderr
