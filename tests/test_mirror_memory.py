"""Host memory of the mirror: allocated once (at the first snapshot), never per step."""

import textwrap

from solo import solo_result

SCRIPT = textwrap.dedent("""
    import json
    import solo
    from megatron_deadpool.mirror import snapshot

    allocs = []
    real_alloc = snapshot.alloc_slot

    def alloc(nbytes, pin):
        allocs.append(nbytes)
        return real_alloc(nbytes, pin)

    snapshot.alloc_slot = alloc
    args, model, opt, sched, state = solo.start(["--hidden-size", "256"])
    p = solo.protect(model, opt, sched, state, replicas=0)
    for _ in range(5):  # the optimizer state exists, the layout is the steady one
        p.before_step(state.iteration)
        solo.step(args, model, opt, sched, state)
        p.after_step(state.iteration)
        p.mirror.wait()
    rss = [solo.rss_bytes()]
    # 50 more iterations of the mirror alone (snapshot metadata, copy, seal, commit): the
    # training step's own allocator noise (several MB either way) is left out.
    for _ in range(50):
        state.iteration += 1
        p.after_step(state.iteration)
        p.mirror.wait()
        rss.append(solo.rss_bytes())
    info = p.finish_info()
    p.close()
    print("RESULT " + json.dumps({"rss": rss, "allocs": allocs, "info": {
        k: info[k] for k in ("host_bytes", "mirror_bytes", "mirror_tensor_bytes",
                             "mirror_jobs", "committed")}}))
""")


def test_resident_set_stays_flat_over_50_snapshots():
    r = solo_result(SCRIPT)
    info, rss = r["info"], r["rss"]
    slot = info["mirror_bytes"]
    assert info["mirror_jobs"] == 56 and info["committed"] == 55  # initial commit + 55
    assert slot > 16 << 20  # one slot per step would be 50 x this
    # Two slots (replicas 0), allocated once; the layout was already the steady one.
    assert r["allocs"] == [slot, slot] and info["host_bytes"] == 2 * slot
    growth = max(rss) - rss[0]
    assert growth < 4 << 20, (growth, slot, rss)
