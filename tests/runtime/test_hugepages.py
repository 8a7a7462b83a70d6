"""model_executor/hugepages.py: the quantized weights moved into a 2 MB-aligned arena with
MADV_HUGEPAGE keep their bytes (outputs bit for bit), the modules point into the arena, and
nothing moves where the switch is off."""

import pytest
import torch
from torch import nn

from lmprog_runtime import config
from lmprog_runtime.model_executor import hugepages
from lmprog_runtime.model_executor.quant import QuantLinear


def _model(act=torch.float32):
    torch.manual_seed(4)
    m = nn.Sequential(QuantLinear("int4", 96, 128, act, bias=True), QuantLinear("int8", 64, 96, act))
    m[0].set_weight(torch.randn(96, 128) * 0.05)
    m[0].bias.copy_(torch.randn(96))
    m[1].set_weight(torch.randn(64, 96) * 0.05)
    return m.eval()


def test_weights_in_the_arena_give_the_same_outputs():
    if not hugepages.usable():
        pytest.skip(f"transparent huge pages unavailable here (mode {hugepages.thp_mode()!r})")
    m, x = _model(), torch.randn(5, 128)
    with torch.no_grad():
        want = m(x)
    before = {(i, k): t.clone() for i, lin in enumerate(m) for k, t in lin._buffers.items()
              if k in hugepages.BUFFERS and t is not None}
    moved = hugepages.place_weights(m)
    assert moved >= sum(t.numel() * t.element_size() for t in before.values())
    arena = m._weight_arena
    lo = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    for (i, k), t in before.items():
        now = m[i]._buffers[k]
        assert lo <= now.data_ptr() < lo + len(arena) and now.data_ptr() % 4096 == 0
        assert now.dtype == t.dtype and torch.equal(now, t)
    with torch.no_grad():
        assert torch.equal(m(x), want)


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setattr(config, "HUGEPAGE_WEIGHTS", False)
    m = _model()
    ptrs = [lin.qweight.data_ptr() for lin in m]
    assert hugepages.place_weights(m) == 0
    assert [lin.qweight.data_ptr() for lin in m] == ptrs and not hasattr(m, "_weight_arena")
