"""The sink fold that serves what cuDNN's sink engine declines (single-query decode): the sink-less
(out, lse) folded with the sinks equals the sink forward, on the fp32 reference (CPU)."""

import torch

from cudnn_attention.cudnn_ops import fold_sinks
from cudnn_attention.masking import make_mask_spec
from cudnn_attention.reference import dense_reference, varlen_reference


def test_fold_gives_the_sink_forward_dense_with_padding_and_empty_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 9, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    sinks = torch.randn(4) * 2
    lengths = dict(seqlens_q_B=torch.tensor([9, 4, 0]), seqlens_kv_B=torch.tensor([11, 0, 5]))
    mask = make_mask_spec(causal=True, bottom_right=True, window_size=(3, -1))
    out, lse = dense_reference(q, k, v, scale=0.3, mask=mask, **lengths)
    want_out, want_lse = dense_reference(q, k, v, scale=0.3, mask=mask, sinks_H=sinks, **lengths)
    fold_sinks(out, lse, sinks)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    # Rows with a key agree; rows without one stay -inf (no key: nothing to attend, the sink included).
    has_key = torch.isfinite(lse)
    torch.testing.assert_close(lse[has_key], want_lse[has_key], rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[~has_key]).all() and out[1].abs().max() == 0


def test_fold_gives_the_sink_forward_packed_and_nan_sinks_stay_nan():
    torch.manual_seed(1)
    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 1, 16), torch.randn(20, 1, 16)
    cu = torch.tensor([0, 1, 7, 17], dtype=torch.int32)  # a length-1 document and a capacity tail of 3
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=(-1, -1))
    sinks = torch.tensor([0.5, float("nan"), -1.0, 3.0])
    out, lse = varlen_reference(q, k, v, cu, cu, 10, 10, scale=0.25, mask=mask)
    want_out, _ = varlen_reference(q, k, v, cu, cu, 10, 10, scale=0.25, mask=mask, sinks_H=sinks)
    fold_sinks(out, lse, sinks)
    assert out[:17, 1].isnan().all() and want_out[:17, 1].isnan().all()
    assert out[17:].abs().max() == 0 and torch.isneginf(lse[17:]).all()
    keep = [0, 2, 3]
    torch.testing.assert_close(out[:, keep], want_out[:, keep], rtol=1e-5, atol=1e-6)
