"""The C RMSNorm (+ residual add) of fused_ops.c against torch's ops, to float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmprog_runtime.model_executor import fused_ops


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 50), (300, 576)])  # 50: a tail after 3 x 16
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, hidden, with_residual):
    if not fused_ops.available():
        pytest.skip("no C compiler: the model keeps torch's RMSNorm")
    torch.manual_seed(rows)
    x, r, w = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
    total = x + r if with_residual else x
    want = F.rms_norm(total, (hidden,), w, eps=1e-5)
    got, got_total = fused_ops.add_rms_norm(x, r if with_residual else None, w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if with_residual:
        assert torch.equal(got_total, total)  # the sum itself is exact
    else:
        assert got_total is None
