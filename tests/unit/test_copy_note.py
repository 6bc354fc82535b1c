"""A copied input is said once, as a warning a filter can silence, not as a log line on every call."""

import logging
import warnings

import torch

import cudnn_attention
from cudnn_attention import CudnnAttentionCopyWarning


def strided_qkv():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 16, generator=generator) for _ in range(3))
    return q[..., ::2], k[..., ::2], v  # q and k: head dim 8 with stride 2, copied before the kernels


def test_a_copied_input_is_said_once_per_input_over_many_calls(caplog):
    q, k, v = strided_qkv()
    with caplog.at_level(logging.DEBUG, logger="cudnn_attention"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # every warning the calls emit is recorded, none hidden by the default once-per-line filter
        outs = [cudnn_attention.attention(q, k, v, causal=True) for _ in range(6)]
    copies = [str(w.message) for w in seen if issubclass(w.category, CudnnAttentionCopyWarning)]
    assert len(copies) == 2 and copies[0].startswith("cudnn_attention: q has innermost stride 2") and " k has " in copies[1], copies
    assert all(w.filename == __file__ for w in seen if issubclass(w.category, CudnnAttentionCopyWarning))  # points at the caller
    assert not [record.getMessage() for record in caplog.records if record.name.startswith("cudnn_attention")]
    expected = cudnn_attention.attention(q.contiguous(), k.contiguous(), v, causal=True)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_warnings_filter_silences_the_copy_note():
    # The first call since the counters were reset (each test starts so): unfiltered, it would warn (test above).
    q, k, v = strided_qkv()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=CudnnAttentionCopyWarning)
        cudnn_attention.attention(q, k, v)
    assert not [str(w.message) for w in seen if "copying" in str(w.message)]


def test_a_misaligned_operand_is_copied_aligned_and_said_once(caplog):
    # cuDNN descriptors need a 16-byte aligned base: an odd offset is copied before the launch, said once, not logged.
    from cudnn_attention import operands

    cudnn_attention.reset_stats()
    misaligned = torch.zeros(4 * 8 + 1, dtype=torch.bfloat16)[1:].view(4, 8)
    assert misaligned.data_ptr() % 16
    with caplog.at_level(logging.DEBUG, logger="cudnn_attention"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        copies = [operands.aligned(misaligned, "q") for _ in range(3)]
    said = [str(w.message) for w in seen if issubclass(w.category, CudnnAttentionCopyWarning)]
    assert said == ["cudnn_attention: copying q to a 16-byte aligned buffer on each such call (said once)"], said
    assert all(copy.data_ptr() % 16 == 0 and torch.equal(copy, misaligned) for copy in copies)
    assert not caplog.records
