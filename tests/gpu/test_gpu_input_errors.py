"""On CUDA, input the host can judge raises the CPU suite's errors before any kernel runs, and without a device sync.

Each check below is pure host work (shapes, dtypes, devices, Python ints), so it runs under
``torch.cuda.set_sync_debug_mode("error")`` (a device sync would raise instead) with every way of computing
attention replaced by an assertion (cuDNN, the exact path, the model's eager attention): the error must come
first. Once these inputs reached the device: a 2-D mask shorter than the input ended in an out-of-bounds
gather and ``CUBLAS_STATUS_INTERNAL_ERROR``, and ``max_seqlen = 2**40`` in a device-side assertion that killed
the process (the prefix-sum check compared it in int32, where it wraps to 0).
"""

import contextlib
import types

import pytest
import torch

import cudnn_attention

transformers = pytest.importorskip("transformers")
from support.hf_models import VOCAB, build  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _attention_reached(*args, **kwargs):
    raise AssertionError("attention was computed before the input error")


@contextlib.contextmanager
def host_only():
    """Inside: no attention may be computed and no device sync may happen (either raises something other than
    the expected error). Work queued before is finished first, and what is queued inside must not fail after."""
    from cudnn_attention import api
    from cudnn_attention.integrations.hf import attention_function

    torch.cuda.synchronize()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "serve", _attention_reached)
        patch.setattr(attention_function, "eager_equivalent", _attention_reached)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _packed(T=20, H=4, H_kv=2, D=64):
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(T, H_kv, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 7, T], device=DEVICE, dtype=torch.int32)
    return q, k, v, cu


# ----------------------------------------------------------------------------------------------
# Packed maxima (the core and the transformers flash kwargs)
# ----------------------------------------------------------------------------------------------

MAXIMA = [((-1, 13), r"max_seqlen_q must be >= 0, got -1")]
# FlashAttention's contract: a maximum is an upper bound (a static 4096 for a 20-token batch), served as if it were the
# token count; only a value below the longest document (a device-side fact) or a negative one is wrong.
UPPER_BOUNDS = [(2**40, 13), (13, 2**40), (21, 13)]


@pytest.mark.parametrize("remembered", [False, True], ids=["fresh", "after a remembered call"])
@pytest.mark.parametrize("maxima, message", MAXIMA, ids=[str(m) for m, _ in MAXIMA])
def test_varlen_maxima_below_zero_are_refused_on_the_host(maxima, message, remembered):
    q, k, v, cu = _packed()
    if remembered:  # a served call's signature must not let one with other maxima skip the checks
        for _ in range(2):
            cudnn_attention.varlen_attention(q, k, v, cu, cu, 13, 13, causal=True)
    with host_only(), pytest.raises(ValueError, match=message):
        cudnn_attention.varlen_attention(q, k, v, cu, cu, *maxima, causal=True)


@pytest.mark.parametrize("maxima", UPPER_BOUNDS, ids=[str(m) for m in UPPER_BOUNDS])
def test_varlen_maxima_past_the_tokens_are_served_as_the_token_count(maxima):
    q, k, v, cu = _packed()
    clamped = cudnn_attention.varlen_attention(q, k, v, cu, cu, *(min(m, 20) for m in maxima), causal=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = cudnn_attention.varlen_attention(q, k, v, cu, cu, *maxima, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, clamped)  # the same graph: keyed by the clamped value


def _hf_packed_call(changes):
    """The transformers attention function on one packed row of 20 tokens, as DataCollatorWithFlattening feeds it,
    with ``changes(cu)`` applied to its kwargs."""
    from cudnn_attention.integrations.hf import cudnn_attention_forward

    q, k, v, cu = _packed()
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13)
    kwargs.update(changes(cu))
    query, key, value = (t[None].transpose(1, 2) for t in (q, k, v))  # (1, H, T, D) views of (1, T, H, D)
    return lambda: cudnn_attention_forward(types.SimpleNamespace(is_causal=True), query, key, value, None, scaling=None, **kwargs)


FLASH_KWARGS = {  # built from the CUDA prefix sums at run time: the CPU suite collects this file too
    "max_length_k=-1": (lambda cu: dict(max_length_k=-1), ValueError, r"max_length_k must be >= 0, got -1"),
    "max_length_k=None": (lambda cu: dict(max_length_k=None), ValueError, r"go together.* without max_length_k"),
    "cu_seq_lens_k on the host": (lambda cu: dict(cu_seq_lens_k=cu.cpu()), ValueError, r"cu_seq_lens_k must be on cuda:0 like q, got cpu"),
    "three documents and two": (
        lambda cu: dict(cu_seq_lens_q=torch.tensor([0, 7, 9, 20], device=cu.device, dtype=cu.dtype)),
        ValueError,
        r"cu_seq_lens_q and cu_seq_lens_k describe different batch sizes: 3 and 2",
    ),
    "cu_seq_lens_q float": (
        lambda cu: dict(cu_seq_lens_q=cu.float()),
        TypeError,
        r"cu_seq_lens_q must be int32 or int64, got torch.float32",
    ),
}


@pytest.mark.parametrize("case", FLASH_KWARGS)
def test_flash_kwargs_are_refused_on_the_host(case):
    changes, error, message = FLASH_KWARGS[case]
    call = _hf_packed_call(changes)
    with host_only(), pytest.raises(error, match=message):
        call()


def test_a_flash_kwargs_maximum_past_the_tokens_is_served_as_the_token_count():
    got = _hf_packed_call(lambda cu: dict(max_length_q=2**40, max_length_k=2**40))()[0]
    assert torch.equal(got, _hf_packed_call(lambda cu: dict(max_length_q=20, max_length_k=20))()[0])


# ----------------------------------------------------------------------------------------------
# transformers attention masks
# ----------------------------------------------------------------------------------------------


def _gpu_model():
    return build("llama", "cudnn", dtype=torch.bfloat16, device=DEVICE, head_dim=64)


def test_a_2d_mask_shorter_than_the_input_is_refused_and_the_process_stays_usable():
    # The user's report: input_ids (2, 11), attention_mask (2, 8): CUBLAS_STATUS_INTERNAL_ERROR after an out-of-bounds gather.
    model = _gpu_model()
    ids = torch.randint(3, VOCAB, (2, 11), device=DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"attention_mask has 8 columns, but the keys number 11 \(0 cached \+ 11 new\)"):
            model(ids, attention_mask=torch.ones(2, 8, dtype=torch.long, device=DEVICE))
        torch.cuda.synchronize()  # no fault was queued
        assert torch.isfinite(model(ids, attention_mask=torch.ones(2, 11, dtype=torch.long, device=DEVICE)).logits).all()


MASK_FUNCTION_CALLS = [
    (
        dict(q_length=11, kv_length=11, q_offset=0, attention_mask=torch.ones(2, 8, dtype=torch.bool)),
        r"attention_mask has 8 columns, but the keys number 11 \(0 cached \+ 11 new\)",
    ),
    (
        dict(q_length=5, kv_length=11, q_offset=6, attention_mask=torch.ones(2, 9, dtype=torch.bool)),
        r"attention_mask has 9 columns, but the keys number 11 \(6 cached \+ 5 new\)",
    ),
    (
        dict(q_length=11, kv_length=11, q_offset=0, attention_mask=torch.ones(1, 11, dtype=torch.bool)),
        r"attention_mask has 1 rows for a batch of 2",
    ),
    (
        dict(q_length=11, kv_length=11, q_offset=0, attention_mask=torch.ones(2, 11, 11, dtype=torch.bool)),
        r"attention_mask must be 2-D \(batch, keys\) or 4-D .*got shape \(2, 11, 11\)",
    ),
]


@pytest.mark.parametrize("call, message", MASK_FUNCTION_CALLS, ids=["short", "short after a prefill", "rows", "rank"])
def test_the_mask_function_refuses_a_mask_that_does_not_fit_on_the_host(call, message):
    from cudnn_attention.integrations.hf import cudnn_attention_mask

    call = {**call, "attention_mask": call["attention_mask"].to(DEVICE)}
    with host_only(), pytest.raises(ValueError, match=message):
        cudnn_attention_mask(batch_size=2, kv_offset=0, device=DEVICE, **call)


def _attention_function_call(mask, q_len=11, kv_len=11):
    from cudnn_attention.integrations.hf import cudnn_attention_forward

    torch.manual_seed(0)
    query = torch.randn(2, q_len, 4, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(2, kv_len, 2, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    mask = mask.to(DEVICE)  # here, not inside host_only: a copy from pageable host memory synchronizes by itself
    return lambda: cudnn_attention_forward(types.SimpleNamespace(is_causal=True), query, key, value, mask, scaling=None)


def _padded(rows, width):
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[0, :2] = False
    return mask


ATTENTION_FUNCTION_MASKS = [
    (_padded(2, 8), ValueError, r"attention_mask has 8 columns \(keys\), fewer than the 11 new tokens"),
    (_padded(1, 11), ValueError, r"attention_mask has 1 rows for a batch of 2"),
    (
        torch.ones(2, 1, 11, 9, dtype=torch.bool),
        ValueError,
        r"4-D attention_mask must have shape \(1 or 2, 1 or 4, 1 or 11, 11\).* got \(2, 1, 11, 9\)",
    ),
    (torch.zeros(2, 3, 11, 11), ValueError, r"got \(2, 3, 11, 11\)"),
    (torch.ones(2, 1, 11, 11, dtype=torch.long), TypeError, r"4-D attention_mask must be bool .* or floating .*, got torch.int64"),
]


@pytest.mark.parametrize("mask, error, message", ATTENTION_FUNCTION_MASKS, ids=["short", "rows", "4-D keys", "4-D heads", "4-D int"])
def test_the_attention_function_refuses_a_mask_that_does_not_fit_on_the_host(mask, error, message):
    call = _attention_function_call(mask)
    with host_only(), pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# The core's metadata
# ----------------------------------------------------------------------------------------------


def _dense(B=2, H=4, H_kv=2, S=16, D=64):
    torch.manual_seed(0)
    return [torch.randn(B, h, S, D, device=DEVICE, dtype=torch.bfloat16) for h in (H, H_kv, H_kv)]


CORE_CALLS = [
    (
        "cu_seqlens on the host",
        lambda q, k, v, cu, cu_host: cudnn_attention.varlen_attention(q, k, v, cu_host, cu, 13, 13),
        ValueError,
        r"cu_seqlens_q must be on cuda:0 like q, got cpu",
    ),
    (
        "cu_seqlens int16",
        lambda q, k, v, cu, cu_host: cudnn_attention.varlen_attention(q, k, v, cu, cu.to(torch.int16), 13, 13),
        TypeError,
        r"cu_seqlens_kv must be int32 or int64, got torch.int16",
    ),
    (
        "document counts differ",
        lambda q, k, v, cu, cu_host: cudnn_attention.varlen_attention(q, k, v, cu, cu[::2].contiguous(), 13, 13),
        ValueError,
        r"cu_seqlens_q and cu_seqlens_kv describe different batch sizes: 2 and 1",
    ),
    (
        "sinks of the wrong length",
        lambda q, k, v, cu, cu_host: cudnn_attention.varlen_attention(q, k, v, cu, cu, 13, 13, sinks=torch.zeros(3, device=DEVICE)),
        ValueError,
        r"sinks must have shape \(4,\).*got \(3,\)",
    ),
    (
        "seqlens of the wrong length",
        lambda q, k, v, cu, cu_host: cudnn_attention.attention(*_dense(), seqlens_q=cu),
        ValueError,
        r"seqlens_q must have shape \(2,\).*got \(3,\)",
    ),
]


@pytest.mark.parametrize("what, call, error, message", CORE_CALLS, ids=[c[0] for c in CORE_CALLS])
def test_core_metadata_that_contradicts_the_tensors_is_refused_on_the_host(what, call, error, message):
    q, k, v, cu = _packed()
    cu_host = cu.cpu()  # before host_only: the copy itself synchronizes, the check under test must not
    with host_only(), pytest.raises(error, match=message):
        call(q, k, v, cu, cu_host)


@pytest.mark.parametrize("packed", [False, True])
def test_strided_sinks_are_read_as_their_values(packed):
    # The kernels read the sinks as H consecutive float32 values: a strided view once gave other heads' logits, silently.
    torch.manual_seed(1)
    fused = torch.randn(8, device=DEVICE, requires_grad=True)
    if packed:
        q, k, v, cu = _packed()
        run = lambda s: cudnn_attention.varlen_attention(q, k, v, cu, cu, 13, 13, causal=True, sinks=s)  # noqa: E731
    else:
        q, k, v = _dense()
        run = lambda s: cudnn_attention.attention(q, k, v, causal=True, sinks=s)  # noqa: E731
    with cudnn_attention.strict():
        strided = run(fused[::2])
        (grad_strided,) = torch.autograd.grad(strided.float().square().sum(), fused)
        dense = run(fused[::2].detach().clone().requires_grad_())
    torch.testing.assert_close(strided, dense, rtol=0, atol=0)
    assert grad_strided[1::2].abs().max() == 0 and grad_strided[::2].abs().max() > 0
