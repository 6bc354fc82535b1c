"""Which rows of packed outputs cuDNN leaves unwritten, with separate prefix sums for q and kv (a GPU diagnostic).

    python3 benchmarks/unwritten_rows.py [--out benchmarks/results/unwritten_rows.jsonl]

The launch code is run with its outputs allocated without any fill and preset to a sentinel, and with no pass after
the kernels; rows still all-sentinel afterwards were not written. Each line compares them, for O, the LSE and dQ/dK/dV,
with the rows :func:`cudnn_attention.launch._set_unwritten_rows` sets after the kernels (queries in no document or in a
document without keys; keys in no document or in a document without queries: "documents") and with the rows that see
no key or that no query sees under the mask ("mask"). The passes are exact when every unwritten row is among the rows
they set (``covered``): a row the kernels skip outside that set would read stale memory. Three layouts (documents
missing either side, documents of different lengths on each side, equal ones) x seven masks x sinks (each sink
forward). Measured 2026-12-02, H200, cuDNN 9.19 (decision 0013).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import cudnn_attention
from cudnn_attention import launch, plan
from cudnn_attention.masking import make_mask_spec, visible_keys

SENTINEL = 1024.0  # exact in bf16 and fp32; no output of random inputs is 1024 in every element of a row

MASKS = {
    "none": (False, False, (-1, -1)),
    "causal": (True, False, (-1, -1)),
    "causal bottom-right": (True, True, (-1, -1)),
    "window (16, 0)": (True, False, (16, 0)),
    "window (16, 0) bottom-right": (True, True, (16, 0)),
    "window (8, 4)": (False, False, (8, 4)),
    "window (8, 4) bottom-right": (False, True, (8, 4)),
}
# (q lengths, kv lengths, q tail, kv tail)
LAYOUTS = {
    "a side missing": ([50, 0, 31, 20, 7], [50, 10, 0, 40, 3], 5, 3),
    "sides of different lengths": ([300, 129, 1, 77], [129, 300, 77, 1], 2, 0),
    "equal": ([129, 1, 77, 300, 5], [129, 1, 77, 300, 5], 4, 4),
}


def _sentinel_outputs():
    """Allocations without their fill, preset to the sentinel; no pass after the kernels."""
    real_forward, real_backward = launch.allocate_forward_outputs, launch.allocate_backward_outputs

    def forward(*args, **kwargs):
        out, lse = real_forward(*args, **{**kwargs, "zero_tails": False})
        for t in (out, lse):
            if t is not None:
                t.fill_(SENTINEL)
        return out, lse

    def backward(*args, **kwargs):
        grads = real_backward(*args, **{**kwargs, "zero_tails": False})
        for t in grads:
            t.fill_(SENTINEL)
        return grads

    launch.allocate_forward_outputs, launch.allocate_backward_outputs = forward, backward
    launch._PASS_AFTER_MIN_ELEMENTS = 1 << 62


def _expected(lengths_q, lengths_kv, T_q, T_kv, causal, bottom_right, window):
    """(query rows, key rows) the passes set, and (query rows, key rows) with no key / no query under the mask."""
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window)
    documents_q, documents_kv = set(range(T_q)), set(range(T_kv))
    mask_q, mask_kv = set(range(T_q)), set(range(T_kv))
    cu_q, cu_kv = [0, *itertools.accumulate(lengths_q)], [0, *itertools.accumulate(lengths_kv)]
    for b, (len_q, len_kv) in enumerate(zip(lengths_q, lengths_kv)):
        if not (len_q and len_kv):
            continue
        documents_q -= set(range(cu_q[b], cu_q[b + 1]))
        documents_kv -= set(range(cu_kv[b], cu_kv[b + 1]))
        visible_1QK = visible_keys(mask, torch.tensor([len_q]), torch.tensor([len_kv]), len_q, len_kv)
        mask_q -= {cu_q[b] + i for i in torch.nonzero(visible_1QK[0].any(1)).flatten().tolist()}
        mask_kv -= {cu_kv[b] + j for j in torch.nonzero(visible_1QK[0].any(0)).flatten().tolist()}
    return documents_q, documents_kv, mask_q, mask_kv


def _unwritten(t: torch.Tensor) -> set:
    return set(torch.nonzero((t.detach().float() == SENTINEL).reshape(t.shape[0], -1).all(1)).flatten().tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON lines there too")
    args = parser.parse_args()
    _sentinel_outputs()
    lines = []
    for sink_forward in ("fold", "engine"):
        plan._SINK_FORWARD = sink_forward  # part of every plan's key
        for sinks, (layout, (lengths_q, lengths_kv, tail_q, tail_kv)), (mask, (causal, bottom_right, window)) in itertools.product(
            (False, True), LAYOUTS.items(), MASKS.items()
        ):
            if sink_forward == "engine" and not sinks:
                continue
            torch.manual_seed(0)
            T_q, T_kv = sum(lengths_q) + tail_q, sum(lengths_kv) + tail_kv
            q = torch.randn(T_q, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(T_kv, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            s = torch.randn(8, device="cuda", requires_grad=True) if sinks else None
            cu_q, cu_kv = (torch.tensor([0, *itertools.accumulate(n)], device="cuda", dtype=torch.int32) for n in (lengths_q, lengths_kv))
            with cudnn_attention.strict():
                out, lse = cudnn_attention.varlen_attention(
                    q,
                    k,
                    v,
                    cu_q,
                    cu_kv,
                    max(lengths_q),
                    max(lengths_kv),
                    causal=causal,
                    bottom_right=bottom_right,
                    window_size=window,
                    sinks=s,
                    return_lse=True,
                )
                unwritten = {"out": _unwritten(out), "lse": _unwritten(lse)}
                out.backward(torch.randn_like(out))
            unwritten.update(dq=_unwritten(q.grad), dk=_unwritten(k.grad), dv=_unwritten(v.grad))
            set_q, set_kv, mask_q, mask_kv = _expected(lengths_q, lengths_kv, T_q, T_kv, causal, bottom_right, window)
            side = {"out": (set_q, mask_q), "lse": (set_q, mask_q), "dq": (set_q, mask_q), "dk": (set_kv, mask_kv), "dv": (set_kv, mask_kv)}
            record = {"sink_forward": sink_forward if sinks else None, "layout": layout, "mask": mask}
            for name, rows in unwritten.items():
                passes_set, masked = side[name]
                record[name] = {
                    "unwritten": len(rows),
                    "covered": rows <= passes_set,
                    "equals documents": rows == passes_set,
                    "equals mask": rows == masked,
                }
            lines.append(record)
            print(json.dumps(record), flush=True)
    print(f"covered everywhere: {all(r[n]['covered'] for r in lines for n in ('out', 'lse', 'dq', 'dk', 'dv'))}")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")


if __name__ == "__main__":
    main()
