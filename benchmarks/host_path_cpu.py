"""Python host cost of the eager cuDNN path, on a CPU: every layer of a served call runs, the launch is stood in for.

The H200 machine's host is shared and noisy (the same code moved by up to 45% between two processes), so this
measures the project's own Python on any machine: ``cudnn_forward`` with a resolved plan of stand-in graphs, whose
launch builds the operand pointer array as ``launch.execute`` does and stops there, for a no-grad forward, a
forward with grad-requiring inputs (through the ``_EagerAttention`` node) and ``torch.autograd.grad`` through it
(B=H=1, S=128, D=64, bf16 on the CPU). Microseconds per call, the least of ten round means (``attention_kernels.host_us_in_turns``).

    python3 benchmarks/host_path_cpu.py
"""

from __future__ import annotations

import argparse
import array
import json

import torch

from attention_kernels import host_us_in_turns
from cudnn_attention import cudnn_ops, launch
from cudnn_attention.call import NO_LENGTHS, AttentionCall, packed_lengths
from cudnn_attention.masking import MaskSpec, make_mask_spec
from cudnn_attention.plan import Plan


class _StandInGraph:
    """What the kernels read of a compiled graph (dense, S=128, D=64; or packed), with no frontend object behind it."""

    def __init__(self, operands: int, *, packed: bool = False):
        self.pointer_order = tuple(range(operands))
        self.out_strides = None if packed else (128 * 64, 128 * 64, 64, 1)
        self.grad_strides = None if packed else (self.out_strides,) * 3
        self.batch = 4  # packed: the bucketed document count
        self.ragged_columns = (("q", 64), ("kv", 64))
        self.workspace_size = 0
        self.full_lengths = None
        self.one_key_per_row = False
        self.mask = MaskSpec()
        self.has_sinks = False


def _launch_stand_in(graph, operands, device_index) -> None:
    array.array("Q", [operands[i].data_ptr() for i in graph.pointer_order])


def _no_device() -> None:
    pass  # CPU tensors: nothing queued


def _us(fn, iters: int) -> float:
    return host_us_in_turns({"": fn}, iters, sync=_no_device)[""]


def host_path_us(iters: int = 20000) -> dict:
    saved = launch.execute
    launch.execute = _launch_stand_in
    try:
        # Forward graphs take q, k, v, O (and the LSE when gradients follow); the backward's take nine operands.
        no_grad_plan = Plan(_StandInGraph(4), None, False, False)
        grad_plan = Plan(_StandInGraph(5), _StandInGraph(9), False, False)
        mask = make_mask_spec(causal=False, bottom_right=False, window_size=(-1, -1))
        grad_call = AttentionCall(packed=False, max_seqlen_q=128, max_seqlen_kv=128, scale=0.125, mask=mask, need_lse=True, needs_grad=True)
        no_grad_call = grad_call.replace(need_lse=False, needs_grad=False)
        torch.manual_seed(0)
        q = torch.randn(1, 1, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        forward = lambda plan, call: cudnn_ops.cudnn_forward(plan, call, q, q, q, sinks=None, lengths=NO_LENGTHS)  # noqa: E731
        with torch.no_grad():
            no_grad = _us(lambda: forward(no_grad_plan, no_grad_call), iters)
        grad_forward = _us(lambda: forward(grad_plan, grad_call), iters)
        out, _ = forward(grad_plan, grad_call)
        grad_out = torch.randn_like(out)
        backward = _us(lambda: torch.autograd.grad(out, q, grad_out, retain_graph=True), iters // 4)
        # A packed no-grad forward of four documents, every layer's call finding its batch's facts (checked prefix sums,
        # derived lengths and offsets) from its prefix sums, as the public function's remembered path does.
        packed_plan = Plan(_StandInGraph(6, packed=True), None, False, False)
        packed_call = AttentionCall(packed=True, documents=4, max_seqlen_q=40, max_seqlen_kv=40, scale=0.125, mask=mask)
        tokens = torch.randn(128, 1, 64, dtype=torch.bfloat16)
        cu = torch.tensor([0, 40, 80, 100, 128], dtype=torch.int32)
        with torch.no_grad():
            packed = _us(
                lambda: cudnn_ops.cudnn_forward(
                    packed_plan, packed_call, tokens, tokens, tokens, sinks=None, lengths=packed_lengths(cu, cu, 128, 128)
                ),
                iters,
            )
    finally:
        launch.execute = saved
    return {"no-grad forward": no_grad, "grad forward": grad_forward, "backward": backward, "packed no-grad forward": packed}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    result = host_path_us(parser.parse_args(argv).iters)
    print(json.dumps({name: round(us, 2) for name, us in result.items()}))
    return result


if __name__ == "__main__":
    main()
