"""``adapters/exact_resume``: what Megatron-LM's checkpoint lacks for an exact resume, written
beside a ``--save`` and put back after ``--load`` (the whole path on the real script:
test_megatron_lm_train.py::test_save_then_load_is_bitwise). Here on a single rank: the
tensor-parallel copies round-trip bitwise, and a checkpoint without them, or with them of
another layout, still loads with one line saying the resume is not exact."""

import textwrap

from solo import solo_result

SCRIPT = textwrap.dedent("""
    import json, logging, sys, tempfile
    from megatron_deadpool.adapters import exact_resume, shard
    import solo

    lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.getLogger("megatron_deadpool").addHandler(Keep())

    args, model, opt, sched, state = solo.start()
    for _ in range(2):
        solo.step(args, model, opt, sched, state)
    root = tempfile.mkdtemp()

    def digest():  # the TP-replicated state: norms, biases, position embeddings
        return {k: v.detach().numpy().tobytes().hex()
                for k, v in shard.tp_replicated_state(model, opt).items()}

    # tp_size 2: the TP-replicated state is written (its parameters and their Adam state)
    exact_resume.save(root, 2, 0, 1, False, model, opt, tp_size=2)
    at_save = digest()
    solo.step(args, model, opt, sched, state)
    moved = digest() != at_save
    rng = exact_resume.load(root, 2, 0, 1, model, opt, tp_size=2)
    out = {"moved": moved, "restored": digest() == at_save, "rng": sorted(rng),
           "kinds": sorted({k.rpartition(".")[2] for k in at_save if k.startswith("opt")}),
           "params": sum(k.startswith("chunk") for k in at_save),
           "lines": list(lines)}
    del lines[:]
    out["missing"] = exact_resume.load(root, 3, 0, 1, model, opt, tp_size=2) is None
    out["other_world"] = exact_resume.load(root, 2, 0, 8, model, opt, tp_size=2) is None
    shard.reset_optimizer_state(opt)  # no optimizer state here (as --no-load-optim)
    out["layout_rng"] = exact_resume.load(root, 2, 0, 1, model, opt, tp_size=2) is not None
    p = exact_resume.path(root, 2, 0)
    whole = open(p, "rb").read()
    with open(p, "wb") as f:  # torn: the first half of the file
        f.write(whole[: len(whole) // 2])
    out["torn"] = exact_resume.load(root, 2, 0, 1, model, opt, tp_size=2) is None
    out["notices"] = list(lines)
    out["path"] = p
    print("RESULT " + json.dumps(out))
""")


def test_tp_copies_round_trip_and_a_bare_checkpoint_still_loads():
    r = solo_result(SCRIPT)
    assert r["moved"] and r["restored"] and r["params"] >= 8, r
    assert r["kinds"] == ["exp_avg", "exp_avg_sq", "param", "step"], r
    assert r["rng"] == ["numpy", "python", "torch", "tracker"] and r["lines"] == [], r
    assert r["missing"] and r["other_world"] and r["layout_rng"], r
    assert len(r["notices"]) == 4 and all("not exact" in x for x in r["notices"]), r
    assert "nothing of DeadPool's beside the checkpoint" in r["notices"][0], r
    assert "world size 1" in r["notices"][1] and "exp_avg" in r["notices"][2], r
    # a torn file: one line naming it, Megatron-LM's own state used (issue 58)
    assert r["torn"] and r["path"] in r["notices"][3] and "cannot be read" in r["notices"][3], r
