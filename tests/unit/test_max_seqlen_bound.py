"""``max_seqlen_*`` is an upper bound, as in FlashAttention: any value at or above the longest document is legal (a static
``max_seqlen=4096`` for a 20-token batch, as CUDA-graph and compile users pass), and is used as the token count when
larger; only a negative value, or one below the longest document, is an error."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import flash_attn_interface
from cudnn_attention.prepare import prepare_packed
from support.reference64 import evaluate_call


def _packed(lengths=(7, 13), H=4, H_kv=2, D=8, tail=0):
    torch.manual_seed(0)
    T = sum(lengths) + tail
    q = torch.randn(T, H, D, requires_grad=True)
    k = torch.randn(T, H_kv, D, requires_grad=True)
    v = torch.randn(T, H_kv, D, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("bound", [13, 20, 21, 4096, 2**40])
@pytest.mark.parametrize("tail", [0, 3])
def test_any_upper_bound_gives_the_reference_result(bound, tail):
    q, k, v, cu = _packed(tail=tail)
    result = evaluate_call("varlen", (q, k, v, cu, cu, bound, bound), dict(causal=True, window_size=(4, 0)))
    assert result["ok"], result["checks"]


def test_a_loose_bound_is_the_token_count_in_the_call_and_its_key():
    q, k, v, cu = _packed(tail=3)
    options = dict(scale=None, causal=True, bottom_right=False, window_size=(-1, -1), sinks=None, return_lse=False, validate=False)
    loose = prepare_packed(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4096, max_seqlen_kv=2**40, **options).call
    tight = prepare_packed(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=q.shape[0], max_seqlen_kv=k.shape[0], **options).call
    assert (loose.max_seqlen_q, loose.max_seqlen_kv) == (q.shape[0], k.shape[0]) and loose == tight


def test_a_remembered_call_with_a_loose_bound_is_served_again():
    q, k, v, cu = _packed()
    first = cudnn_attention.varlen_attention(q, k, v, cu, cu, 4096, 4096, causal=True)
    again = cudnn_attention.varlen_attention(q, k, v, cu, cu, 4096, 4096, causal=True)
    assert torch.equal(first, again)


def test_a_bound_below_the_longest_document_is_still_refused():
    q, k, v, cu = _packed()
    with pytest.raises(ValueError, match="has 13 tokens, more than max_seqlen_q 12"):
        cudnn_attention.varlen_attention(q, k, v, cu, cu, 12, 13)


def test_flash_attn_varlen_func_takes_a_static_bound():
    q, k, v, cu = _packed()
    tight = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True)
    loose = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu, cu, 4096, 4096, causal=True)
    # The exact path lays documents out by the bound, so the sums' order (not their terms) differs: fp32 rounding apart.
    torch.testing.assert_close(loose, tight, rtol=1e-6, atol=1e-6)
