"""Bad and borderline input matrix: each case raises a clear error naming the argument and value, or equals the float64 reference.

Outcomes (the table printed at the end, and written to ``$CUDNN_ATTENTION_BAD_INPUT_REPORT`` when set):

* ``clear error``  TypeError/ValueError whose message names the argument and the offending value (expected);
* ``correct``      the result (and gradients) match ``reference64`` under the tolerance rule (expected);
* ``fails loudly`` invalid ``cu_seqlens`` with ``validate=False`` on CUDA: a device-side assertion, i.e. an error
                   and a nonzero exit, but no illegal memory access (expected);
* ``unclear error`` an error of the right type whose message does not name the argument/value;
* ``silent-wrong`` returned a result where an error was due, or a result that does not match the reference;
* ``crash``        any other exception, a dead process, or a CUDA illegal memory access.

CPU cases (float32 and friends, served by the exact fallback) run in-process. GPU cases (bfloat16 on CUDA) run
each in its own subprocess, eight at a time, so a CUDA fault is one failing case, not a dead suite:
``python tests/unit/test_bad_inputs.py --case NAME`` runs one and prints its outcome.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support` when run as a script

import pytest  # noqa: E402
import torch  # noqa: E402

import cudnn_attention  # noqa: E402
from support.reference64 import evaluate_call  # noqa: E402

GOOD = ("clear error", "correct", "fails loudly")
RESULTS: dict[str, tuple[str, str]] = {}  # "name[device]" -> (outcome, detail)
CASES: dict[str, tuple[tuple[str, ...], object]] = {}


def case(name: str, devices=("cpu",)):
    def register(fn):
        CASES[name] = (tuple(devices), fn)
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# Inputs and expectations
# ----------------------------------------------------------------------------------------------


def _dtype(dev):
    return torch.float32 if dev == "cpu" else torch.bfloat16


def dense(dev, B=2, H=4, H_kv=2, S=5, S_kv=None, D=8, D_v=None, dtype=None, grad=False, seed=0):
    torch.manual_seed(seed)
    dtype = dtype or _dtype(dev)
    S_kv = S if S_kv is None else S_kv
    D_v = D if D_v is None else D_v
    q = torch.randn(B, H, S, D, dtype=dtype, device=dev)
    k = torch.randn(B, H_kv, S_kv, D, dtype=dtype, device=dev)
    v = torch.randn(B, H_kv, S_kv, D_v, dtype=dtype, device=dev)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def cu(lengths, dev, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype, device=dev)


def packed(dev, lengths=(2, 4), lengths_kv=None, tail=0, H=4, H_kv=2, D=8, D_v=None, dtype=None, grad=False, seed=0):
    """``(q, k, v, cu_q, cu_kv, max_q, max_kv)`` for documents of the given lengths (plus a capacity tail)."""
    torch.manual_seed(seed)
    dtype = dtype or _dtype(dev)
    lengths_kv = lengths if lengths_kv is None else lengths_kv
    D_v = D if D_v is None else D_v
    T_q, T_kv = sum(lengths) + tail, sum(lengths_kv) + tail
    q = torch.randn(T_q, H, D, dtype=dtype, device=dev).requires_grad_(grad)
    k = torch.randn(T_kv, H_kv, D, dtype=dtype, device=dev).requires_grad_(grad)
    v = torch.randn(T_kv, H_kv, D_v, dtype=dtype, device=dev).requires_grad_(grad)
    return q, k, v, cu(lengths, dev), cu(lengths_kv, dev), max(lengths, default=0), max(lengths_kv, default=0)


def expect_error(kinds, pattern: str, thunk) -> tuple[str, str]:
    """The call must raise one of ``kinds`` with a message matching ``pattern`` (regex, case-insensitive)."""
    try:
        result = thunk()
    except kinds as exc:
        message = f"{type(exc).__name__}: {exc}"
        if re.search(pattern, str(exc), flags=re.IGNORECASE):
            return "clear error", message
        return "unclear error", f"{message}  (expected /{pattern}/)"
    except Exception as exc:  # noqa: BLE001
        return "crash", f"{type(exc).__name__}: {exc}"[:500]
    shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
    return "silent-wrong", f"returned {shape} instead of raising {'/'.join(k.__name__ for k in kinds)} /{pattern}/"


def expect_reference(api: str, args: tuple, kwargs: dict, *, grads=True, floor_rel=None) -> tuple[str, str]:
    """The call must match ``reference64`` (output, lse when asked, every gradient)."""
    try:
        result = evaluate_call(api, args, kwargs, grads=grads, floor_rel=floor_rel)
    except Exception as exc:  # noqa: BLE001
        return "crash", f"{type(exc).__name__}: {exc}"[:500]
    if result["ok"]:
        worst = ", ".join(f"{k} {v:.2g}" for k, v in result["error_summary"].items())
        return "correct", f"errors: {worst}; shapes {result['shapes'].get('out')}"
    return "silent-wrong", "; ".join(f"{c['name']}: {c['why']}" for c in result["checks"] if not c["ok"])[:800]


def expect_loud(thunk, dev) -> tuple[str, str]:
    """Invalid prefix sums with ``validate=False``: a ValueError (validated anyway) or a device-side assertion."""
    try:
        out = thunk()
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
            float(out.float().sum().item())
    except ValueError as exc:
        if re.search(r"cu_seqlens|max_seqlen", str(exc)):
            return "clear error", f"ValueError: {exc}"
        return "unclear error", f"ValueError: {exc}"
    except RuntimeError as exc:
        text = str(exc)
        if re.search(r"illegal memory access|misaligned address|unspecified launch failure", text, re.IGNORECASE):
            return "crash", f"RuntimeError: {text[:300]}"
        return "fails loudly", f"RuntimeError: {text.splitlines()[0][:200]}"
    except Exception as exc:  # noqa: BLE001
        return "crash", f"{type(exc).__name__}: {exc}"[:300]
    return "silent-wrong", "returned a result for invalid cu_seqlens without any error"


VE, TE = (ValueError,), (TypeError,)
A, VA = cudnn_attention.attention, cudnn_attention.varlen_attention


def _other(dev):
    """A device other than ``dev`` that needs no hardware: ``meta`` (CPU cases) or ``cpu`` (GPU cases)."""
    return "meta" if dev == "cpu" else "cpu"


# ----------------------------------------------------------------------------------------------
# q, k, v: ranks, dtypes, devices, shapes
# ----------------------------------------------------------------------------------------------


@case("q_rank3_dense")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"q must be 4-D.*\(4, 5, 8\)", lambda: A(q[0], k, v))


@case("k_rank5_dense")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"k must be 4-D.*\(1, 2, 2, 5, 8\)", lambda: A(q, k[None], v))


@case("v_rank2_dense")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"v must be 4-D.*\(5, 8\)", lambda: A(q, k, v[0, 0]))


@case("q_rank4_packed")
def _(dev):
    q, k, v, *rest = packed(dev)
    return expect_error(VE, r"q must be 3-D", lambda: VA(q[None], k, v, *rest))


@case("q_int32")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(TE, r"q must be a floating-point tensor, got torch.int32", lambda: A(q.int(), k.int(), v.int()))


@case("v_bool")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(TE, r"v must be a floating-point tensor, got torch.bool", lambda: A(q, k, v > 0))


@case("q_list")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(TE, r"q must be a torch.Tensor, got list", lambda: A(q.tolist(), k, v))


@case("k_none")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(TE, r"k must be a torch.Tensor, got NoneType", lambda: A(q, None, v))


@case("mixed_dtypes_f32_f64", devices=("cpu",))
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"share one dtype.*k=torch.float64", lambda: A(q, k.double(), v))


@case("mixed_dtypes_f16_bf16", devices=("cpu", "cuda"))
def _(dev):
    q, k, v = dense(dev, dtype=torch.bfloat16)
    return expect_error(VE, r"share one dtype.*v=torch.float16", lambda: A(q, k, v.half()))


@case("v_on_other_device", devices=("cpu", "cuda"))
def _(dev):
    q, k, v = dense(dev)
    other = _other(dev)
    return expect_error(VE, rf"one device.*v={other}", lambda: A(q, k, v.to(other)))


@case("batch_mismatch")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"batch sizes differ: q 2, k 1, v 1", lambda: A(q, k[:1], v[:1]))


@case("kv_key_count_mismatch")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"same number of keys", lambda: A(q, k, v[:, :, :3]))


@case("kv_head_count_mismatch")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"same number of heads, got 2 and 1", lambda: A(q, k, v[:, :1]))


@case("head_dim_mismatch")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"same head dim, got 8 and 4", lambda: A(q, k[..., :4], v))


@case("head_dim_mismatch_packed")
def _(dev):
    q, k, v, *rest = packed(dev)
    return expect_error(VE, r"same head dim, got 8 and 6", lambda: VA(q, k[..., :6], v, *rest))


@case("head_dim_zero", devices=("cpu", "cuda"))
def _(dev):
    q, k, v = dense(dev, D=0)
    return expect_error(VE, r"head dim", lambda: A(q, k, v))


@case("head_dim_zero_packed")
def _(dev):
    q, k, v, *rest = packed(dev, D=0)
    return expect_error(VE, r"head dim", lambda: VA(q, k, v, *rest))


@case("heads_not_multiple")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"query heads \(3\) must be a multiple of key/value heads \(2\)", lambda: A(q[:, :3], k, v))


@case("kv_heads_zero")
def _(dev):
    q, k, v = dense(dev)
    return expect_error(VE, r"key/value heads \(0\)", lambda: A(q, k[:, :0], v[:, :0]))


@case("heads_not_multiple_packed")
def _(dev):
    q, k, v, *rest = packed(dev, H=6, H_kv=4)
    return expect_error(VE, r"query heads \(6\) must be a multiple of key/value heads \(4\)", lambda: VA(q, k, v, *rest))


@case("kv_token_mismatch_packed")
def _(dev):
    q, k, v, *rest = packed(dev)
    return expect_error(VE, r"same number of keys", lambda: VA(q, k, v[:-1], *rest))


# ----------------------------------------------------------------------------------------------
# scale
# ----------------------------------------------------------------------------------------------


@case("scale_nan")
def _(dev):
    return expect_error(VE, r"scale must be finite, got nan", lambda: A(*dense(dev), scale=float("nan")))


@case("scale_inf")
def _(dev):
    return expect_error(VE, r"scale must be finite, got inf", lambda: A(*dense(dev), scale=float("inf")))


@case("scale_minus_inf_packed")
def _(dev):
    return expect_error(VE, r"scale must be finite, got -inf", lambda: VA(*packed(dev), scale=-math.inf))


@case("scale_string")
def _(dev):
    return expect_error(TE, r"scale must be a float or None, got '0.1'", lambda: A(*dense(dev), scale="0.1"))


@case("scale_bool")
def _(dev):
    return expect_error(TE, r"scale must be a float or None, got True", lambda: A(*dense(dev), scale=True))


@case("scale_tensor")
def _(dev):
    return expect_error(TE, r"scale must be a float or None, got tensor", lambda: A(*dense(dev), scale=torch.tensor(0.1)))


@case("scale_zero_uniform", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference("dense", dense(dev, D=D, S=37, grad=True), dict(scale=0.0, causal=True))


@case("scale_negative", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference("dense", dense(dev, D=D, S=29, grad=True), dict(scale=-0.3, window_size=(5, 2)))


@case("scale_zero_packed_sinks", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 128
    sinks = torch.randn(4, device=dev).requires_grad_()
    return expect_reference("varlen", packed(dev, lengths=(3, 1, 0, 9), tail=2, D=D, grad=True), dict(scale=0.0, causal=True, sinks=sinks))


@case("scale_negative_packed", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 128
    return expect_reference(
        "varlen", packed(dev, lengths=(7, 12), lengths_kv=(9, 3), D=D, grad=True), dict(scale=-1.0, causal=True, bottom_right=True)
    )


@case("scale_python_int")
def _(dev):
    return expect_reference("dense", dense(dev, grad=True), dict(scale=1))


# ----------------------------------------------------------------------------------------------
# sinks
# ----------------------------------------------------------------------------------------------


def _nan_sinks(dev, H=4):
    sinks = torch.randn(H, device=dev)
    sinks[1] = float("nan")
    return sinks


@case("sinks_nan", devices=("cpu", "cuda"))
def _(dev):
    # NaN in -> NaN out, like torch: every row of head 1 is NaN, the other heads are right.
    D = 8 if dev == "cpu" else 64
    return expect_reference("dense", dense(dev, D=D, S=17), dict(causal=True, sinks=_nan_sinks(dev)), grads=False)


@case("sinks_nan_packed", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference("varlen", packed(dev, lengths=(5, 11), D=D), dict(sinks=_nan_sinks(dev)), grads=False)


@case("sinks_wrong_length")
def _(dev):
    return expect_error(VE, r"sinks must have shape \(4,\).*got \(3,\)", lambda: A(*dense(dev), sinks=torch.zeros(3, device=dev)))


@case("sinks_2d")
def _(dev):
    return expect_error(VE, r"sinks must have shape \(4,\).*got \(1, 4\)", lambda: A(*dense(dev), sinks=torch.zeros(1, 4, device=dev)))


@case("sinks_int64")
def _(dev):
    return expect_error(
        TE,
        r"sinks must be a floating-point tensor, got torch.int64",
        lambda: A(*dense(dev), sinks=torch.zeros(4, dtype=torch.int64, device=dev)),
    )


@case("sinks_other_device", devices=("cpu", "cuda"))
def _(dev):
    other = _other(dev)
    return expect_error(VE, rf"sinks must be on .*got {other}", lambda: A(*dense(dev), sinks=torch.zeros(4, device=other)))


@case("sinks_list")
def _(dev):
    return expect_error(TE, r"sinks must be a torch.Tensor, got list", lambda: A(*dense(dev), sinks=[0.0] * 4))


@case("sinks_float64_with_float32")
def _(dev):
    sinks = torch.randn(4, dtype=torch.float64).requires_grad_()
    return expect_reference("dense", dense(dev, grad=True), dict(causal=True, sinks=sinks))


@case("sinks_huge_finite")
def _(dev):
    sinks = torch.tensor([30.0, -30.0, 0.0, 5.0], device=dev).requires_grad_()
    return expect_reference("dense", dense(dev, grad=True), dict(sinks=sinks))


# ----------------------------------------------------------------------------------------------
# seqlens (dense right padding)
# ----------------------------------------------------------------------------------------------


def _lengths(values, dev, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=dev)


@case("seqlens_float")
def _(dev):
    return expect_error(
        TE, r"seqlens_kv must be int32 or int64, got torch.float32", lambda: A(*dense(dev), seqlens_kv=torch.tensor([1.0, 2.0], device=dev))
    )


@case("seqlens_wrong_length")
def _(dev):
    return expect_error(VE, r"seqlens_q must have shape \(2,\).*got \(3,\)", lambda: A(*dense(dev), seqlens_q=_lengths([1, 2, 3], dev)))


@case("seqlens_2d")
def _(dev):
    return expect_error(VE, r"seqlens_q must have shape \(2,\).*got \(2, 1\)", lambda: A(*dense(dev), seqlens_q=_lengths([[1], [2]], dev)))


@case("seqlens_other_device", devices=("cpu", "cuda"))
def _(dev):
    other = _other(dev)
    return expect_error(VE, rf"seqlens_q must be on .*got {other}", lambda: A(*dense(dev), seqlens_q=_lengths([1, 2], other)))


@case("seqlens_list")
def _(dev):
    return expect_error(TE, r"seqlens_q must be a torch.Tensor, got list", lambda: A(*dense(dev), seqlens_q=[1, 2]))


@case("seqlens_negative_q", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    kwargs = dict(causal=True, seqlens_q=_lengths([-1, 3], dev), seqlens_kv=_lengths([5, 4], dev), return_lse=True)
    return expect_reference("dense", dense(dev, D=D, grad=True), kwargs)


@case("seqlens_negative_kv", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    sinks = torch.randn(4, device=dev).requires_grad_()
    kwargs = dict(seqlens_q=_lengths([4, 5], dev, torch.int64), seqlens_kv=_lengths([-5, 2], dev, torch.int64), sinks=sinks)
    return expect_reference("dense", dense(dev, D=D, grad=True), kwargs)


@case("seqlens_longer_than_S_bottom_right", devices=("cpu", "cuda"))
def _(dev):
    # Lengths are clamped to [0, S] first; the bottom-right diagonal uses the clamped lengths.
    D = 8 if dev == "cpu" else 64
    kwargs = dict(causal=True, bottom_right=True, seqlens_q=_lengths([9, 2], dev), seqlens_kv=_lengths([3, 40], dev))
    return expect_reference("dense", dense(dev, D=D, S=5, S_kv=7, grad=True), kwargs)


@case("seqlens_zero_length_rows", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    sinks = torch.randn(4, device=dev).requires_grad_()
    kwargs = dict(causal=True, sinks=sinks, seqlens_q=_lengths([0, 3, 5], dev), seqlens_kv=_lengths([4, 0, 5], dev), return_lse=True)
    return expect_reference("dense", dense(dev, B=3, D=D, grad=True), kwargs)


@case("seqlens_kv_zero_q_positive", devices=("cpu", "cuda"))
def _(dev):
    # No key at all: zero output, lse -inf, zero (never NaN) gradients.
    D = 8 if dev == "cpu" else 64
    kwargs = dict(seqlens_q=_lengths([5, 5], dev), seqlens_kv=_lengths([0, 0], dev), return_lse=True)
    return expect_reference("dense", dense(dev, D=D, grad=True), kwargs)


@case("seqlens_all_zero")
def _(dev):
    kwargs = dict(causal=True, seqlens_q=_lengths([0, 0], dev), seqlens_kv=_lengths([0, 0], dev))
    return expect_reference("dense", dense(dev, grad=True), kwargs)


@case("seqlens_validate_out_of_range")
def _(dev):
    return expect_error(
        VE, r"seqlens_kv must lie in \[0, 5\], got \[-1, 2\]", lambda: A(*dense(dev), seqlens_kv=_lengths([-1, 2], dev), validate=True)
    )


# ----------------------------------------------------------------------------------------------
# cu_seqlens and max_seqlen (packed)
# ----------------------------------------------------------------------------------------------


def _packed_with(dev, **changes):
    q, k, v, cu_q, cu_kv, max_q, max_kv = packed(dev)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv)
    args.update(changes)
    return args


@case("cu_float")
def _(dev):
    return expect_error(
        TE,
        r"cu_seqlens_q must be int32 or int64, got torch.float32",
        lambda: VA(**_packed_with(dev, cu_seqlens_q=torch.tensor([0.0, 2.0, 6.0], device=dev))),
    )


@case("cu_rank2")
def _(dev):
    return expect_error(
        VE, r"cu_seqlens_kv must be 1-D.*got shape \(1, 3\)", lambda: VA(**_packed_with(dev, cu_seqlens_kv=cu([2, 4], dev)[None]))
    )


@case("cu_length1")
def _(dev):
    bad = torch.tensor([0], dtype=torch.int32, device=dev)
    return expect_error(
        VE,
        r"cu_seqlens_q must be 1-D with B \+ 1 >= 2 entries, got shape \(1,\)",
        lambda: VA(**_packed_with(dev, cu_seqlens_q=bad, cu_seqlens_kv=bad)),
    )


@case("cu_other_device", devices=("cpu", "cuda"))
def _(dev):
    other = _other(dev)
    return expect_error(VE, rf"cu_seqlens_q must be on .*got {other}", lambda: VA(**_packed_with(dev, cu_seqlens_q=cu([2, 4], other))))


@case("cu_batch_mismatch")
def _(dev):
    return expect_error(VE, r"different batch sizes: 2 and 1", lambda: VA(**_packed_with(dev, cu_seqlens_kv=cu([6], dev))))


@case("cu_list")
def _(dev):
    return expect_error(TE, r"cu_seqlens_q must be a torch.Tensor, got list", lambda: VA(**_packed_with(dev, cu_seqlens_q=[0, 2, 6])))


@case("max_seqlen_float")
def _(dev):
    return expect_error(TE, r"max_seqlen_q must be a Python int, got 4.0", lambda: VA(**_packed_with(dev, max_seqlen_q=4.0)))


@case("max_seqlen_tensor")
def _(dev):
    return expect_error(
        TE, r"max_seqlen_kv must be a Python int, got tensor", lambda: VA(**_packed_with(dev, max_seqlen_kv=torch.tensor(4)))
    )


@case("max_seqlen_bool")
def _(dev):
    return expect_error(TE, r"max_seqlen_q must be a Python int, got True", lambda: VA(**_packed_with(dev, max_seqlen_q=True)))


@case("max_seqlen_negative")
def _(dev):
    return expect_error(VE, r"max_seqlen_kv.*-1", lambda: VA(**_packed_with(dev, max_seqlen_kv=-1)))


@case("max_seqlen_zero_all_empty_docs", devices=("cpu", "cuda"))
def _(dev):
    # Every document empty (all six tokens a capacity tail), max_seqlen 0: zeros, zero gradients.
    D = 8 if dev == "cpu" else 64
    return expect_reference("varlen", packed(dev, lengths=(0, 0), tail=6, D=D, grad=True), dict(causal=True))


@case("empty_packed_T0", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference("varlen", packed(dev, lengths=(0,), D=D, grad=True), dict(causal=True))


@case("empty_packed_T0_max1", devices=("cpu", "cuda"))
def _(dev):
    # max_seqlen is an upper bound (FlashAttention's meaning): above the token count, here none, it is the token count.
    D = 8 if dev == "cpu" else 64
    q, k, v, cu_q, cu_kv, _, _ = packed(dev, lengths=(0,), D=D, grad=True)
    return expect_reference("varlen", (q, k, v, cu_q, cu_kv, 1, 1), dict(causal=True))


@case("max_seqlen_past_T", devices=("cpu", "cuda"))
def _(dev):
    # A static bound larger than the batch (CUDA-graph and compile users pass one): the token count is used.
    D = 8 if dev == "cpu" else 64
    q, k, v, cu_q, cu_kv, max_q, _ = packed(dev, D=D, grad=True)
    return expect_reference("varlen", (q, k, v, cu_q, cu_kv, max_q, 7), dict(causal=True))


@case("max_seqlen_2_pow_40", devices=("cpu", "cuda"))
def _(dev):
    # Once a device-side assertion on CUDA (the check's int32 comparison wrapped 2**40 to 0) and an 8 TiB allocation on CPU;
    # clamped to the token count before anything else reads it.
    D = 8 if dev == "cpu" else 64
    q, k, v, cu_q, cu_kv, _, max_kv = packed(dev, D=D, grad=True)
    return expect_reference("varlen", (q, k, v, cu_q, cu_kv, 2**40, max_kv), dict(causal=True))


@case("max_seqlen_negative", devices=("cpu", "cuda"))
def _(dev):
    return expect_error(VE, r"max_seqlen_q must be >= 0, got -1", lambda: VA(**_packed_with(dev, max_seqlen_q=-1)))


@case("doc_with_queries_but_no_keys", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    sinks = torch.randn(4, device=dev).requires_grad_()
    args = packed(dev, lengths=(4, 3, 5), lengths_kv=(6, 0, 2), D=D, grad=True)
    return expect_reference("varlen", args, dict(causal=True, bottom_right=True, sinks=sinks, return_lse=True))


INVALID_CU = {
    # name: (cu_seqlens_q values over 6 tokens, max_seqlen_q (at most 6: a larger one is refused first), message pattern)
    "non_monotonic": ([0, 4, 2], 4, r"cu_seqlens_q.*non-decreasing.*4"),
    "end_past_T": ([0, 2, 9], 6, r"cu_seqlens_q\[-1\] = 9 exceeds the 6"),
    "start_not_zero": ([1, 2, 6], 4, r"cu_seqlens_q must start at 0, got 1"),
    "doc_longer_than_max": ([0, 2, 6], 3, r"cu_seqlens_q has 4 tokens, more than max_seqlen.* 3"),
    "negative_entry": ([0, -2, 6], 6, r"cu_seqlens_q.*non-decreasing.*-2"),
}


def _invalid_cu_call(dev, which, validate):
    values, max_q, _ = INVALID_CU[which]
    q, k, v, _, cu_kv, _, max_kv = packed(dev, D=8 if dev == "cpu" else 64)
    bad = torch.tensor(values, dtype=torch.int32, device=dev)
    return lambda: VA(q, k, v, bad, cu_kv, max_q, max_kv, causal=True, validate=validate)


for _which in INVALID_CU:

    @case(f"cu_{_which}_validate_true", devices=("cpu", "cuda"))
    def _(dev, _which=_which):
        return expect_error(VE, INVALID_CU[_which][2], _invalid_cu_call(dev, _which, True))

    @case(f"cu_{_which}_validate_false", devices=("cpu", "cuda"))
    def _(dev, _which=_which):
        if dev == "cpu":  # validated on CPU whatever `validate` says: it costs no sync there
            return expect_error(VE, INVALID_CU[_which][2], _invalid_cu_call(dev, _which, False))
        return expect_loud(_invalid_cu_call(dev, _which, False), dev)


@case("cu_kv_doc_longer_than_max_validate_false")
def _(dev):
    q, k, v, cu_q, cu_kv, max_q, _ = packed(dev)
    return expect_error(VE, r"cu_seqlens_kv has 4 tokens, more than max_seqlen.* 2", lambda: VA(q, k, v, cu_q, cu_kv, max_q, 2))


# ----------------------------------------------------------------------------------------------
# window_size / causal
# ----------------------------------------------------------------------------------------------


@case("window_one_element")
def _(dev):
    return expect_error(VE, r"window_size must be a \(left, right\) pair, got \(3,\)", lambda: A(*dense(dev), window_size=(3,)))


@case("window_string")
def _(dev):
    return expect_error(VE, r"window_size must be a \(left, right\) pair, got 'ab'", lambda: A(*dense(dev), window_size="ab"))


@case("window_none")
def _(dev):
    return expect_error(VE, r"window_size must be a \(left, right\) pair, got None", lambda: A(*dense(dev), window_size=None))


@case("window_float_bound")
def _(dev):
    return expect_error(TE, r"window_size left bound must be an int, got 1.5", lambda: A(*dense(dev), window_size=(1.5, 0)))


@case("window_left_below_minus1")
def _(dev):
    return expect_error(VE, r"left bound must be >= 0, or -1 for unbounded; got -2", lambda: A(*dense(dev), window_size=(-2, 0)))


@case("window_right_below_minus1_packed")
def _(dev):
    return expect_error(VE, r"right bound must be >= 0, or -1 for unbounded; got -5", lambda: VA(*packed(dev), window_size=(0, -5)))


@case("causal_with_right_window")
def _(dev):
    return expect_error(
        VE, r"causal=True hides every future key but window_size=\(4, 2\) admits 2", lambda: A(*dense(dev), causal=True, window_size=(4, 2))
    )


@case("window_as_list", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference("dense", dense(dev, D=D, S=21, grad=True), dict(window_size=[2, 3]))


@case("causal_with_left_window")
def _(dev):
    return expect_reference("dense", dense(dev, S=9, grad=True), dict(causal=True, window_size=(2, 0)))


@case("window_diagonal_only_bottom_right")
def _(dev):
    return expect_reference(
        "varlen", packed(dev, lengths=(3, 5), lengths_kv=(6, 2), grad=True), dict(window_size=(0, 0), bottom_right=True)
    )


# ----------------------------------------------------------------------------------------------
# Empty dense tensors
# ----------------------------------------------------------------------------------------------


@case("dense_S_q_zero", devices=("cpu", "cuda"))
def _(dev):
    return expect_reference("dense", dense(dev, S=0, S_kv=5, D=8 if dev == "cpu" else 64, grad=True), dict(causal=True))


@case("dense_S_kv_zero_sinks", devices=("cpu", "cuda"))
def _(dev):
    sinks = torch.randn(4, device=dev).requires_grad_()
    return expect_reference("dense", dense(dev, S=5, S_kv=0, D=8 if dev == "cpu" else 64, grad=True), dict(sinks=sinks))


@case("dense_B_zero", devices=("cpu", "cuda"))
def _(dev):
    return expect_reference("dense", dense(dev, B=0, D=8 if dev == "cpu" else 64, grad=True), dict())


# ----------------------------------------------------------------------------------------------
# Layouts and dtypes
# ----------------------------------------------------------------------------------------------


def _qkv_packed(dev, T, H, D, grad=True):
    torch.manual_seed(1)
    buf = torch.randn(T, 3, H, D, dtype=_dtype(dev), device=dev).requires_grad_(grad)
    return buf.unbind(1)  # interleaved rows: token stride 3*H*D


@case("interleaved_qkv_dense")
def _(dev):
    torch.manual_seed(1)
    buf = torch.randn(2, 7, 3, 4, 8, dtype=_dtype(dev), device=dev).requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in buf.unbind(2))
    return expect_reference("dense", (q, k, v), dict(causal=True))


@case("interleaved_qkv_packed_D128", devices=("cpu", "cuda"))
def _(dev):
    q, k, v = _qkv_packed(dev, 40, 4, 128)
    c = cu([17, 1, 0, 20], dev)
    sinks = torch.randn(4, device=dev).requires_grad_()
    return expect_reference("varlen", (q, k, v, c, c, 20, 20), dict(causal=True, sinks=sinks))


@case("interleaved_qkv_packed_D256", devices=("cuda",))
def _(dev):
    q, k, v = _qkv_packed(dev, 300, 4, 256)
    c = cu([130, 1, 100, 60], dev)
    return expect_reference("varlen", (q, k, v, c, c, 130, 130), dict(causal=True, window_size=(33, 0)))


@case("interleaved_qkv_dense_D128", devices=("cuda",))
def _(dev):
    torch.manual_seed(1)
    buf = torch.randn(2, 77, 3, 8, 128, dtype=_dtype(dev), device=dev).requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in buf.unbind(2))
    return expect_reference("dense", (q, k, v), dict(causal=True, seqlens_q=_lengths([77, 0], dev), seqlens_kv=_lengths([50, 0], dev)))


@case("gqa_fused_split_packed", devices=("cpu", "cuda"))
def _(dev):
    torch.manual_seed(2)
    D = 8 if dev == "cpu" else 64
    buf = torch.randn(30, 8 + 2 + 2, D, dtype=_dtype(dev), device=dev).requires_grad_()
    q, k, v = buf.split([8, 2, 2], dim=1)
    c = cu([10, 10, 7], dev)
    return expect_reference("varlen", (q, k, v, c, c, 10, 10), dict(causal=True))


@case("head_major_packed_sinks", devices=("cpu", "cuda"))
def _(dev):
    torch.manual_seed(3)
    D = 8 if dev == "cpu" else 64
    q = torch.randn(4, 23, D, dtype=_dtype(dev), device=dev).transpose(0, 1).requires_grad_()
    k = torch.randn(2, 23, D, dtype=_dtype(dev), device=dev).transpose(0, 1).requires_grad_()
    v = torch.randn(23, 2, D, dtype=_dtype(dev), device=dev).requires_grad_()
    sinks = torch.randn(4, device=dev).requires_grad_()
    c = cu([9, 1, 13], dev)
    return expect_reference("varlen", (q, k, v, c, c, 13, 13), dict(causal=True, window_size=(4, 0), sinks=sinks))


@case("noncontiguous_head_dim", devices=("cpu", "cuda"))
def _(dev):
    torch.manual_seed(4)
    D = 8 if dev == "cpu" else 128
    q = torch.randn(2, 4, 5, 2 * D, dtype=_dtype(dev), device=dev)[..., ::2].requires_grad_()  # head-dim stride 2
    k = torch.randn(2, 2, 5, 2 * D, dtype=_dtype(dev), device=dev)[..., ::2].requires_grad_()
    v = torch.randn(2, 2, 5, D, dtype=_dtype(dev), device=dev).requires_grad_()
    return expect_reference("dense", (q, k, v), dict(causal=True))


@case("broadcast_kv_heads")
def _(dev):
    q, k, v = dense(dev, H_kv=1)
    k, v = k.expand(2, 2, 5, 8).requires_grad_(False), v.expand(2, 2, 5, 8)
    return expect_reference("dense", (q.requires_grad_(), k, v), dict(causal=True))


@case("float64_inputs")
def _(dev):
    return expect_reference("dense", dense(dev, dtype=torch.float64, grad=True), dict(window_size=(1, 1)), floor_rel=1e-12)


@case("bfloat16_on_cpu")
def _(dev):
    return expect_reference("dense", dense(dev, dtype=torch.bfloat16, grad=True), dict(causal=True))


@case("float16_on_cpu_packed")
def _(dev):
    return expect_reference("varlen", packed(dev, lengths=(3, 0, 6), tail=1, dtype=torch.float16, grad=True), dict(causal=True))


@case("only_q_requires_grad")
def _(dev):
    q, k, v = dense(dev)
    return expect_reference("dense", (q.requires_grad_(), k, v), dict(causal=True))


@case("gqa8_window_float32_sinks", devices=("cuda",))
def _(dev):
    sinks = torch.randn(16, device=dev).requires_grad_()
    return expect_reference("dense", dense(dev, H=16, H_kv=2, S=130, D=64, grad=True), dict(causal=True, window_size=(31, 0), sinks=sinks))


@case("bottom_right_more_queries_than_keys", devices=("cpu", "cuda"))
def _(dev):
    D = 8 if dev == "cpu" else 64
    return expect_reference(
        "dense",
        dense(dev, S=40, S_kv=24, D=D, dtype=torch.float16 if dev != "cpu" else None, grad=True),
        dict(causal=True, bottom_right=True),
    )


@case("head_dim_264_beyond_cudnn", devices=("cuda",))
def _(dev):
    return expect_reference("dense", dense(dev, D=264, S=33, grad=True), dict(causal=True))


@case("head_dim_36_not_multiple_of_8", devices=("cuda",))
def _(dev):
    return expect_reference("varlen", packed(dev, lengths=(11, 20), D=36, grad=True), dict(causal=True))


@case("value_dim_differs_packed", devices=("cpu", "cuda"))
def _(dev):
    D, D_v = (8, 12) if dev == "cpu" else (128, 64)
    return expect_reference("varlen", packed(dev, lengths=(11, 1, 20), D=D, D_v=D_v, grad=True), dict(causal=True))


# ----------------------------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------------------------


def _ids(device):
    return [name for name, (devices, _) in CASES.items() if device in devices]


def run_named(name: str, device: str) -> tuple[str, str]:
    _, fn = CASES[name]
    try:
        return fn(device)
    except Exception as exc:  # noqa: BLE001 - a bug in building the case still reports as a case
        return "crash", f"{type(exc).__name__}: {exc} | {traceback.format_exc()[-600:]}"


def report_table() -> str:
    width = max([len(k) for k in RESULTS] + [4])
    lines = [f"{'case':<{width}}  {'outcome':<13}  detail"]
    for key in sorted(RESULTS, key=lambda k: (k.split("[")[-1], k)):
        outcome, detail = RESULTS[key]
        lines.append(f"{key:<{width}}  {outcome:<13}  {detail.splitlines()[0][:160] if detail else ''}")
    counts = {}
    for outcome, _ in RESULTS.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    lines.append("")
    lines.append("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"  ({len(RESULTS)} cases)")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if not RESULTS:
        return
    table = report_table()
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line("bad-input matrix:")
        for line in table.splitlines():
            reporter.write_line(line)
    if os.environ.get("CUDNN_ATTENTION_BAD_INPUT_REPORT"):
        Path(os.environ["CUDNN_ATTENTION_BAD_INPUT_REPORT"]).write_text(table + "\n", encoding="utf-8")


@pytest.mark.parametrize("name", _ids("cpu"))
def test_cpu_bad_input(name):
    outcome, detail = run_named(name, "cpu")
    RESULTS[f"{name}[cpu]"] = (outcome, detail)
    assert outcome in GOOD, f"{name}: {outcome}: {detail}"


def test_matrix_is_large_enough():
    assert len(_ids("cpu")) + len(_ids("cuda")) >= 60
    assert len(_ids("cpu")) >= 60


def _run_in_subprocess(name: str, timeout: float = 300.0) -> tuple[str, str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--case", name, "--device", "cuda"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        return "crash", f"timed out after {timeout:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("BAD_INPUT_RESULT "):
            outcome, detail = json.loads(line[len("BAD_INPUT_RESULT ") :])
            if done.returncode != 0 and outcome in GOOD and outcome != "fails loudly":
                # A good verdict followed by a dying process (e.g. a fault at exit) is still a crash.
                return "crash", f"{outcome} but exit status {done.returncode}: {done.stderr[-300:]}"
            return outcome, detail
    stderr = done.stderr.strip()
    if re.search(r"illegal memory access|misaligned address", stderr, re.IGNORECASE):
        return "crash", f"exit status {done.returncode}: {stderr[-300:]}"
    if name.endswith("_validate_false") and done.returncode != 0 and stderr:
        return "fails loudly", f"exit status {done.returncode}: {stderr.splitlines()[-1][:200]}"
    return "crash", f"exit status {done.returncode}, no verdict: {stderr[-400:]}"


@pytest.mark.gpu
def test_gpu_bad_inputs():
    names = _ids("cuda")
    with ThreadPoolExecutor(max_workers=int(os.environ.get("CUDNN_ATTENTION_BAD_INPUT_WORKERS", "8"))) as pool:
        verdicts = dict(zip(names, pool.map(_run_in_subprocess, names)))
    for name, verdict in verdicts.items():
        RESULTS[f"{name}[cuda]"] = verdict
    bad = {name: verdict for name, verdict in verdicts.items() if verdict[0] not in GOOD}
    assert not bad, "GPU bad-input cases failed:\n" + "\n".join(f"  {n}: {o}: {d}" for n, (o, d) in bad.items())


if __name__ == "__main__":
    import argparse
    import warnings

    parser = argparse.ArgumentParser(description="Run one bad-input case and print its verdict.")
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--device", default="cuda")
    cli = parser.parse_args()
    warnings.simplefilter("ignore", cudnn_attention.CudnnAttentionFallbackWarning)
    verdict = run_named(cli.case, cli.device)
    print("BAD_INPUT_RESULT " + json.dumps(list(verdict)), flush=True)
    if cli.device.startswith("cuda") and verdict[0] != "fails loudly":
        torch.cuda.synchronize()  # an asynchronous fault after the verdict turns it into a crash
    sys.exit(0)
