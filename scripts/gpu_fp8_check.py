#!/usr/bin/env python3
"""The FP8 state check, for a lent GPU with Transformer Engine: does a promoted spare get
TE's FP8 scaling state (amax history, scales) from the snapshot?

A bf16 model of TE layers trains a few steps under ``fp8_autocast`` (delayed scaling, whose
amax history is state), then its snapshot is written: parameters, optimizer state, and each
module's extra state through the package's own path (``adapters/extra_state.capture``,
``mirror/metadata.encode``). The same process then runs one forward on a fixed batch and
one more step. A fresh process builds the model from scratch, restores the snapshot
(``extra_state.apply``), runs the same forward and step, and compares, bit for bit:

* ``restored``: with the extra state handed back -> must be equal;
* ``without_extra_state``: the control, the same restore without it -> expected to differ
  (it shows that the check can fail; TE's fresh scaling state is not the trained one).

    python scripts/gpu_fp8_check.py --out fp8.json

Exit 0 only if ``restored`` is equal. Never run so far: no device with TE has been lent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS, HIDDEN, BATCH = 4, 256, 32


def build():
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16),
        te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def step(model, opt, x):
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(
            fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")):
        y = model(x)
    loss = y.float().pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return y


def digest(model, y) -> str:
    h = hashlib.sha256(y.detach().float().cpu().numpy().tobytes())
    for _, p in sorted(model.state_dict().items()):
        if hasattr(p, "detach"):
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def batch(i: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100 + i)
    return torch.randn(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def train_and_snapshot(path: str) -> str:
    import torch

    from megatron_deadpool.adapters import extra_state
    from megatron_deadpool.mirror import metadata

    model, opt = build()
    for i in range(STEPS):
        step(model, opt, batch(i))
    params = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    held = extra_state.capture(extra_state.holders([model]))
    blob = metadata.encode({"module_extra_state": held})
    torch.save({"params": params, "opt": opt.state_dict(), "meta": blob}, path)
    return digest(model, step(model, opt, batch(STEPS)))


def restore_and_step(path: str, with_extra: bool) -> str:
    import torch

    from megatron_deadpool.adapters import extra_state
    from megatron_deadpool.mirror import metadata

    model, opt = build()
    snap = torch.load(path, weights_only=True)  # tensors, numbers, bytes
    model.load_state_dict(snap["params"], strict=False)
    opt.load_state_dict(snap["opt"])
    if with_extra:
        states = metadata.decode(snap["meta"])["module_extra_state"]
        extra_state.apply(extra_state.holders([model]), states)
    return digest(model, step(model, opt, batch(STEPS)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_check.json")
    ap.add_argument("--snapshot", default="fp8_snapshot.pt")
    ap.add_argument("--phase", choices=["all", "restore", "control"], default="all")
    a = ap.parse_args()
    if a.phase != "all":  # a fresh process: nothing of the trained model is in memory
        print(restore_and_step(a.snapshot, with_extra=a.phase == "restore"))
        return 0
    trained = train_and_snapshot(a.snapshot)
    fresh = {}
    for phase in ("restore", "control"):
        p = subprocess.run([sys.executable, __file__, "--phase", phase, "--snapshot",
                            a.snapshot], capture_output=True, text=True, check=True)
        fresh[phase] = p.stdout.split()[-1]
    result = {"trained_next_step": trained, "restored_equal": fresh["restore"] == trained,
              "without_extra_state_equal": fresh["control"] == trained}
    import transformer_engine

    result["transformer_engine"] = transformer_engine.__version__
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0 if result["restored_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
