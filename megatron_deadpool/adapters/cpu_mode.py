"""CPU mode: run real megatron-core (GPTModel, DDP + distributed optimizer, pipeline
schedules) on CPU tensors with gloo.

This is a *CPU mode for testing and demos*, not a GPU substitute: it redirects the
handful of CUDA calls megatron-core makes to their CPU equivalents so that the exact
same megatron-core code paths run on machines without a GPU. It is process-global and
is switched on only by an explicit call to :func:`enable`, never by importing a module.
Call it before megatron builds anything.

What it stands in for (each one exercised by tests/test_cpu_mode.py):

* ``torch.cuda.current_device()``            -> ``torch.device('cpu')``
* factory calls / ``.to`` with a cuda device -> rewritten to cpu (a TorchFunctionMode)
* ``Tensor.cuda()``                           -> identity
* ``Tensor.type()`` (no argument)             -> cpu tensors spell as ``torch.cuda.*``
  (DistributedOptimizer dispatches on that string)
* streams, events, synchronize, memory stats -> no-op stand-ins
* CUDA RNG (torch.cuda and megatron's tracker helpers) -> the CPU default generator,
  so megatron's RNG tracker forks and restores the generator dropout actually uses.
* ``torch.cuda.is_available()``               -> True (megatron/training asks)
* ``torch.accelerator``                        -> none, as in a CPU-only build of torch
* megatron-core features whose GPU kernels (apex, TE) CPU lacks: ``cpu_standins.py``
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.overrides import TorchFunctionMode

from . import cpu_standins

_STATE = {"enabled": False, "mode": None, "saved": {}}
_LOCK = threading.Lock()


def is_enabled() -> bool:
    return _STATE["enabled"]


def _is_cuda_device(dev) -> bool:
    if dev is None:
        return False
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # a bare int device index means a CUDA device
    return False


_CPU = torch.device("cpu")


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites cuda devices in torch function calls to cpu."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if _is_cuda_device(dev):
            kwargs["device"] = _CPU
        name = getattr(func, "__name__", "")
        if name in ("to", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor") and args:
            args = tuple(_CPU if (i > 0 and _is_cuda_device(a) and not isinstance(a, bool))
                         else a for i, a in enumerate(args))
        if name in ("pin_memory",):
            return args[0]
        if "pin_memory" in kwargs and kwargs["pin_memory"]:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a, **k):
        self.device = _CPU

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


@contextlib.contextmanager
def _null_ctx(*a, **k):
    yield


class _Props:
    major = 8
    minor = 0
    name = "cpu-mode"
    total_memory = 16 * 2**30
    multi_processor_count = 1


def _cpu_get_rng_state(device="cuda", *a, **k):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, *a, **k):
    torch.set_rng_state(new_state)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    orig = _STATE["saved"]["Tensor.type"]
    if dtype is None:
        s = orig(self)
        if self.device.type == "cpu" and s.startswith("torch.") and not s.startswith("torch.cuda."):
            return "torch.cuda." + s[len("torch."):]
        return s
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda."):]
    return orig(self, dtype, non_blocking, **kwargs)


def _cuda_stand_ins() -> dict:
    # Every stand-in is a distinct function object: torch._dynamo builds a rule map keyed
    # by function identity and refuses one object registered under two names.
    def zero():
        return lambda *a, **k: 0

    def none():
        return lambda *a, **k: None

    return {
        "is_available": lambda: True,
        "current_device": lambda: _CPU,
        "device_count": lambda: 1,
        "set_device": none(),
        "synchronize": none(),
        "empty_cache": none(),
        "ipc_collect": none(),
        "is_initialized": lambda: True,
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda *a, **k: _NullStream(),
        "default_stream": lambda *a, **k: _NullStream(),
        "stream": _null_ctx,
        "device": _null_ctx,
        "get_device_properties": lambda *a, **k: _Props(),
        "get_device_capability": lambda *a, **k: (8, 0),
        "get_device_name": lambda *a, **k: "cpu-mode",
        "memory_allocated": zero(),
        "max_memory_allocated": zero(),
        "memory_reserved": zero(),
        "max_memory_reserved": zero(),
        "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": none(),
        "reset_max_memory_allocated": none(),
        "mem_get_info": lambda *a, **k: (16 * 2**30, 16 * 2**30),
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": _cpu_set_rng_state,
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
    }


def enable(set_env: bool = True) -> None:
    """Switch CPU mode on for this process (idempotent)."""
    with _LOCK:
        if _STATE["enabled"]:
            return
        if set_env:
            # megatron's jit fuser is torch.compile; dynamo cannot trace through the mode.
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        saved = _STATE["saved"]
        for name, fn in _cuda_stand_ins().items():
            saved["cuda." + name] = getattr(torch.cuda, name, None)
            setattr(torch.cuda, name, fn)
        saved["cuda.random.get_rng_state"] = torch.cuda.random.get_rng_state
        saved["cuda.random.set_rng_state"] = torch.cuda.random.set_rng_state
        torch.cuda.random.get_rng_state = _cpu_get_rng_state
        torch.cuda.random.set_rng_state = _cpu_set_rng_state
        saved["Tensor.cuda"] = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        saved["Tensor.type"] = torch.Tensor.type
        torch.Tensor.type = _type
        saved["Tensor.pin_memory"] = torch.Tensor.pin_memory
        # torch's device-generic layer answers as a CPU-only build does (a CUDA build of
        # torch on a machine without a driver would otherwise ask the driver in Adam.step)
        for name, fn in (("is_available", lambda: False),
                         ("current_accelerator", lambda check_available=False: None)):
            saved["accelerator." + name] = getattr(torch.accelerator, name, None)
            setattr(torch.accelerator, name, fn)
        torch.Tensor.pin_memory = lambda self, *a, **k: self
        _patch_megatron_rng()
        cpu_standins.install()  # Megatron features whose GPU kernels CPU lacks
        mode = _CudaToCpuMode()
        mode.__enter__()
        _STATE["mode"] = mode
        _STATE["enabled"] = True


def _patch_megatron_rng() -> None:
    """Point megatron's private CUDA RNG helpers at the CPU generator."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core not installed: nothing to patch
        return

    def _get(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    import logging

    class _SameGenerator(logging.Filter):
        # In CPU mode the "CUDA" generator *is* the CPU generator, so the tracker's
        # "CPU RNG state changed within GPU RNG context" check is expected to fire.
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_SameGenerator())
    mrandom._get_cuda_rng_state = _get
    mrandom._set_cuda_rng_state = _set
    import megatron.core.tensor_parallel as tp

    for name, fn in (("_get_cuda_rng_state", _get), ("_set_cuda_rng_state", _set)):
        if hasattr(tp, name):
            setattr(tp, name, fn)
    try:  # megatron/training imports fused kernels that need CUDA_HOME
        import megatron.legacy.fused_kernels as fk  # type: ignore

        fk.load = lambda *a, **k: None
    except Exception:  # noqa: BLE001 - optional module, absent from the PyPI wheel
        pass
