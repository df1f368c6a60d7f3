"""Optimizer state kept per param group (TE / apex FusedAdam keep Adam's ``step`` in
``param_group["step"]``, not per parameter) is mirrored and restored: a rolled-back
survivor and a promoted spare resume with the step of the restored iteration."""

import textwrap

from solo import solo_result

SCRIPT = textwrap.dedent("""
    import json
    import torch
    import solo
    from megatron_deadpool.adapters import shard
    from megatron_deadpool.adapters import train_state as ts
    from megatron_deadpool.mirror.exchange import Exchange
    from megatron_deadpool.mirror.mirror import Mirror
    from megatron_deadpool.mirror.rounds import StoreRounds
    from types import SimpleNamespace

    from megatron_deadpool.control.attachment import Attachment
    from megatron_deadpool.control.link import MirrorSettings
    from megatron_deadpool.recovery import restore

    class GroupStepAdam(torch.optim.Optimizer):
        '''Adam as TE FusedAdam keeps it: step per param group, moments per param; empty
        groups do not count steps. Swapped in as the class of megatron's inner optimizer
        (its param groups, lr, betas, eps and weight decay stay as megatron set them).'''

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                if not g["params"]:
                    continue
                g["step"] = g.get("step", 0) + 1
                (b1, b2), t = g["betas"], g["step"]
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["exp_avg"] = torch.zeros_like(p)
                        st["exp_avg_sq"] = torch.zeros_like(p)
                    m, v = st["exp_avg"], st["exp_avg_sq"]
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    denom = (v / (1 - b2 ** t)).sqrt_().add_(g["eps"])
                    p.addcdiv_(m, denom, value=-g["lr"] / (1 - b1 ** t))

    args, model, opt, sched, state = solo.start()
    for d in shard.distributed_optimizers(opt):
        d.optimizer.__class__ = GroupStepAdam

    def steps():
        return [g.get("step") for d in shard.distributed_optimizers(opt)
                for g in d.optimizer.param_groups if g["params"]]

    def digest():
        meta = ts.capture(state.iteration, state, sched, opt, with_cuda=False)
        return shard.rank_digest(model, opt, meta) + json.dumps(steps())

    p = Attachment(MirrorSettings(replicas=1, create_timeout_s=60, op_timeout_s=60))
    p.model, p.optimizer, p.scheduler, p.train_state = model, opt, sched, state
    m = Mirror(0, 1, sources=lambda: shard.shard_tensors(opt, placeholders=True)
               + shard.unreplicated_tensors(model, 1))
    m.exchange = Exchange(m.holdings, solo.SoloTransport(), [], [], 1)
    p.mirror, p.commits = m, m.commits
    link = SimpleNamespace(rounds=StoreRounds(torch.distributed.HashStore(), 0, 1))  # as Links.connect makes it
    p._initial_commit_pending = True
    p.before_step(0)
    for _ in range(3):
        solo.step(args, model, opt, sched, state)
        p.after_step(state.iteration)
        m.wait()
    at3 = digest()
    solo.step(args, model, opt, sched, state)  # step 4: never snapshotted
    at4 = digest()
    out = {"steps_at_4": steps()}

    assert restore.run(p.restoring(0, link)) == 3
    out["rollback_steps"] = steps()
    out["rollback_bitwise"] = digest() == at3
    solo.step(args, model, opt, sched, state)
    out["rerun_bitwise"] = digest() == at4

    # A promoted spare: fresh optimizer state, created by one dummy step (restore.transfer
    # does this for a rank that receives its copy), which counts as step 1.
    shard.reset_optimizer_state(opt)
    for d in shard.distributed_optimizers(opt):
        for g in d.optimizer.param_groups:
            g.pop("step", None)
        d._init_optimizer_states_with_dummy_values()
    out["spare_steps_before"] = steps()
    assert restore.run(p.restoring(0, link)) == 3
    out["spare_steps"] = steps()
    out["spare_bitwise"] = digest() == at3
    m.close()
    print("RESULT " + json.dumps(out))
""")


def test_per_group_step_is_mirrored_and_restored():
    r = solo_result(SCRIPT)
    assert r["steps_at_4"] and set(r["steps_at_4"]) == {4}, r  # the optimizer is per-group
    assert set(r["spare_steps_before"]) == {1}, r
    assert set(r["rollback_steps"]) == {3}, r
    assert set(r["spare_steps"]) == {3}, r
    assert r["rollback_bitwise"] and r["rerun_bitwise"] and r["spare_bitwise"], r
