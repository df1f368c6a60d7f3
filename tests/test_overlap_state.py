"""``--overlap-grad-reduce`` / ``--overlap-param-gather`` across a rebuild, on a real
megatron-core DDP (world of one, gloo, CPU mode): pending bucket handles are dropped, never
waited on; every bucket group is rebound to the new groups (a stale one fails the audit);
and training goes on over the new groups."""

import textwrap

from solo import solo_result

SCRIPT = textwrap.dedent("""
    import json, os, socket
    import torch
    import torch.distributed as dist
    import megatron.core.distributed as mcd
    from megatron.core import parallel_state as ps

    class Overlapped(mcd.DistributedDataParallelConfig):
        def __init__(self, **kw):
            kw.update(overlap_grad_reduce=True, overlap_param_gather=True)
            super().__init__(**kw)

    mcd.DistributedDataParallelConfig = Overlapped  # what trainer/gpt.py builds with
    import solo
    from megatron_deadpool.base.errors import RebindAuditError
    from megatron_deadpool.adapters import ddp
    from megatron_deadpool.recovery.rebind import GroupSlots

    args, model, opt, sched, state = solo.start()
    solo.step(args, model, opt, sched, state)  # the first batch records the golden counts
    out = {"overlap": model[0].ddp_config.overlap_grad_reduce}
    # a step cut short: backward issues async reduce-scatters as buckets get ready; a
    # parameter all-gather is in flight too
    model[0].zero_grad_buffer()
    for bg in ddp.bucket_groups(model):
        bg.is_last_microbatch = True
    loss = sum(p.float().sum() for p in model[0].parameters())
    loss.backward()
    model[0].start_param_sync()
    out["pending_before"] = ddp.pending(model)

    slots = GroupSlots([model, opt])
    old = {id(bg.intra_distributed_optimizer_instance_group) for bg in ddp.bucket_groups(model)}
    # the abort: the world and the groups go; the handles must not be waited on
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    out["dropped"] = ddp.drop_pending(model)
    out["pending_after"] = ddp.pending(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    ps.initialize_model_parallel(1, 1)
    slots.rebind()
    slots.audit()
    new_dp = ps.get_data_parallel_group(with_context_parallel=True)
    out["rebound"] = all(
        bg.intra_distributed_optimizer_instance_group is new_dp
        and id(bg.intra_distributed_optimizer_instance_group) not in old
        for bg in ddp.bucket_groups(model))
    out["first_batch"] = all(bg.is_first_batch and not bg.param_gather_dispatched
                             for bg in ddp.bucket_groups(model))
    # the redone step runs on the new groups
    for _ in range(2):
        solo.step(args, model, opt, sched, state)
    out["pending_end"] = ddp.pending(model)
    # a bucket group left on an old group is caught
    stale_pg = dist.new_group([0], backend="gloo")
    bg = next(iter(ddp.bucket_groups(model)))
    bg.intra_distributed_optimizer_instance_group = stale_pg
    try:
        slots.audit()
        out["stale_caught"] = False
    except RebindAuditError as exc:
        out["stale_caught"] = "intra_distributed_optimizer_instance_group" in str(exc)
    print("RESULT " + json.dumps(out))
""")


def test_pending_bucket_handles_dropped_and_groups_rebound():
    r = solo_result(SCRIPT)
    assert r["overlap"] is True
    assert r["pending_before"] >= 1 and r["dropped"] >= 1 and r["pending_after"] == 0, r
    assert r["rebound"] and r["first_batch"], r
    assert r["pending_end"] == 0
    assert r["stale_caught"], r
