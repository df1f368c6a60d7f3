"""``shard.digest_parts``: the final state hashed per part, so that a fingerprint mismatch
names what differs (the parts a test failure prints: ``conftest.state_diff``)."""

import textwrap

from solo import solo_result

SCRIPT = textwrap.dedent("""
    import json
    import random
    from megatron_deadpool.adapters import shard
    from megatron_deadpool.adapters import train_state as ts
    import solo

    args, model, opt, sched, state = solo.start()
    solo.step(args, model, opt, sched, state)

    def parts():
        meta = ts.capture(state.iteration, state, sched, opt, with_cuda=False)
        return shard.digest_parts(model, opt, meta)

    def changed(a, b):
        return sorted(k for k in a if a[k] != b[k])

    p0 = parts()
    out = {"keys": sorted(p0), "same": changed(p0, parts())}
    random.random()
    p1 = parts()
    out["after_python_random"] = changed(p0, p1)
    solo.step(args, model, opt, sched, state)
    out["after_step"] = changed(p1, parts())
    print("RESULT " + json.dumps(out))
""")


def test_digest_parts_name_what_changed():
    r = solo_result(SCRIPT)
    assert {"params", "optimizer", "iteration", "rng.python", "rng.torch"} <= set(r["keys"]), r
    assert r["same"] == [], r
    assert r["after_python_random"] == ["rng.python"], r
    assert {"params", "optimizer", "iteration"} <= set(r["after_step"]), r
