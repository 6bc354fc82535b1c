"""The host path's shortcuts keep their semantics: the C-level autograd apply the eager training call uses, and the
host benchmarks' timing in turns (``benchmarks/attention_kernels.py``, ``benchmarks/host_path_cpu.py``, each checked in a
child interpreter that imports it, ``support.benchmark_scripts``)."""

import inspect

import pytest
import torch

from cudnn_attention import _compat, cudnn_ops
from support.benchmark_scripts import check_in_script


class _Scale(torch.autograd.Function):
    """Saves an input and an output as _EagerAttention does, with a non-tensor argument beside them."""

    @staticmethod
    def forward(ctx, x, factor):
        out = x * factor
        ctx.save_for_backward(x, out)
        ctx.factor = factor
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ctx.saved_tensors  # unpacking is where autograd checks their versions
        return grad_out * ctx.factor, None


def test_c_level_apply_records_the_same_node_and_gradients_as_apply():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    raw = _compat.autograd_apply(_Scale)
    want, got = _Scale.apply(x, 3.0), raw(x, 3.0)
    assert type(got.grad_fn) is type(want.grad_fn) and type(got.grad_fn).__name__ == "_ScaleBackward"
    grad_want, grad_got = (torch.autograd.grad(out, x, torch.ones_like(out))[0] for out in (want, got))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=0)


def test_c_level_apply_keeps_the_saved_tensor_check():
    # save_for_backward's version check is what stops a backward from reading an input written in place since.
    x = torch.randn(3, requires_grad=True)
    y = x.clone()
    out = _compat.autograd_apply(_Scale)(y, 2.0)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_eager_attention_goes_through_the_c_level_apply():
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, cudnn_ops._EagerAttention)
    assert cudnn_ops._eager_attention == c_apply
    # Up to torch 2.13 the public apply is a Python classmethod in front of the C one; from 2.14 it is the C one.
    python_layer = isinstance(inspect.getattr_static(torch.autograd.Function, "apply"), classmethod)
    assert (cudnn_ops._eager_attention != cudnn_ops._EagerAttention.apply) == python_layer


def test_without_the_c_level_apply_the_public_one_serves(monkeypatch):
    monkeypatch.setattr(torch._C, "_FunctionBase", type("Moved", (), {}))
    assert _compat.autograd_apply(_Scale) == _Scale.apply


def test_host_timing_takes_turns_and_keeps_each_ones_least_round():
    code = """
        import time

        order, calls = [], {"slow first round": 0, "steady": 0}

        def slow_first_round():
            calls["slow first round"] += 1
            order.append("a")
            time.sleep(0.004 if 100 < calls["slow first round"] <= 110 else 0.0005)  # the first timed round (after 100 warm-up calls)

        def steady():
            calls["steady"] += 1
            order.append("b")
            time.sleep(0.001)

        fns = {"slow first round": slow_first_round, "steady": steady}
        best = attention_kernels.host_us_in_turns(fns, iters=40, rounds=4, sync=lambda: None)
        assert calls == {"slow first round": 140, "steady": 140}, calls  # 100 warm-up calls, then 4 rounds of 10
        timed = "".join(order[200:])
        assert timed == ("a" * 10 + "b" * 10) * 4, timed  # in turns, a round each
        assert 500 <= best["slow first round"] < 4000, best  # the kept round is not the slow one (each call >= 4 ms there)
        assert best["steady"] >= 1000, best
    """
    check_in_script("attention_kernels", code)


def test_cpu_host_benchmark_runs_the_served_path_and_puts_the_launch_back():
    code = """
        from cudnn_attention import launch as cudnn_launch

        launch = cudnn_launch.execute
        result = host_path_cpu.main(["--iters", "40"])
        assert set(result) == {"no-grad forward", "grad forward", "backward", "packed no-grad forward"}, result
        assert all(0 < us < 1e5 for us in result.values()), result
        assert cudnn_launch.execute is launch
    """
    check_in_script("host_path_cpu", code)
