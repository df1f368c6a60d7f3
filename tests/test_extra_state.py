"""Module extra state (Transformer Engine's FP8 scaling state) travels in the snapshot's
metadata: captured after a step, through the metadata format, into a freshly built model
(a promoted spare's), bitwise; None (Megatron's local layers) carries nothing."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_deadpool.adapters import extra_state
from megatron_deadpool.base.errors import DeadpoolError
from megatron_deadpool.mirror import metadata


class Fp8Like(torch.nn.Module):
    """As TE's modules do: the scaling state is a pickle in a uint8 tensor (newer TE) or a
    BytesIO (older TE), outside parameters and buffers."""

    def __init__(self, as_bytesio: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.fp8_meta = {"amax_history": torch.zeros(8, 2), "scale": torch.ones(2)}
        self.as_bytesio = as_bytesio

    def forward(self, x):  # an amax update, as an FP8 forward makes one
        self.fp8_meta["amax_history"] = torch.roll(self.fp8_meta["amax_history"], 1, 0)
        self.fp8_meta["amax_history"][0] = x.abs().max()
        self.fp8_meta["scale"] = 448.0 / self.fp8_meta["amax_history"].max(0).values
        return x * self.weight

    def get_extra_state(self):
        buf = io.BytesIO()
        torch.save(self.fp8_meta, buf)
        if self.as_bytesio:
            return buf
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state):
        if isinstance(state, torch.Tensor):
            state = io.BytesIO(state.numpy().tobytes())
        state.seek(0)
        self.fp8_meta = torch.load(state)


class Local(torch.nn.Module):  # Megatron's local linear layers: extra state is None
    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        raise AssertionError("never called for None")


def _model(as_bytesio=False):
    return torch.nn.Sequential(Fp8Like(as_bytesio), Local(), torch.nn.Linear(4, 4))


@pytest.mark.parametrize("as_bytesio", [False, True])
def test_scaling_state_reaches_a_fresh_model_bitwise(as_bytesio):
    torch.manual_seed(0)
    trained = [_model(as_bytesio)]
    for _ in range(3):
        trained[0][0](torch.randn(4))
    captured = extra_state.capture(extra_state.holders(trained))
    assert list(captured) == ["chunk0.0"]  # Local's None and Linear carry nothing
    meta = metadata.decode(metadata.encode({"module_extra_state": captured}))
    fresh = [_model(as_bytesio)]
    assert not torch.equal(fresh[0][0].fp8_meta["scale"], trained[0][0].fp8_meta["scale"])
    extra_state.apply(extra_state.holders(fresh), meta["module_extra_state"])
    for k in ("amax_history", "scale"):
        assert torch.equal(fresh[0][0].fp8_meta[k], trained[0][0].fp8_meta[k])
    x = torch.randn(4)  # the next forward, and its scaling update, match
    assert torch.equal(fresh[0][0](x), trained[0][0](x))
    assert torch.equal(fresh[0][0].fp8_meta["scale"], trained[0][0].fp8_meta["scale"])


def test_the_capture_is_a_copy_not_a_view():
    m = [_model()]
    captured = extra_state.capture(extra_state.holders(m))
    before = captured["chunk0.0"].clone()
    m[0][0](torch.full((4,), 7.0))
    assert torch.equal(captured["chunk0.0"], before)


def test_a_model_without_extra_state_adds_nothing():
    assert extra_state.capture(extra_state.holders(
        [torch.nn.Sequential(Local(), torch.nn.Linear(2, 2))])) == {}


def test_an_unknown_module_or_type_is_refused():
    with pytest.raises(DeadpoolError, match="unknown modules"):
        extra_state.apply(extra_state.holders([torch.nn.Linear(2, 2)]), {"chunk0.x": b"1"})

    class Odd(Local):
        def get_extra_state(self):
            return {"a": 1}

    with pytest.raises(DeadpoolError, match="cannot mirror"):
        extra_state.capture(extra_state.holders([Odd()]))
