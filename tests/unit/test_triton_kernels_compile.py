"""Every Triton kernel of the package compiles for Hopper (sm_90) with the Triton this torch ships, on a machine without a
GPU: ``triton.compile`` lowers to PTX and runs the bundled ptxas, and needs no device. The GPU tests run the kernels
on torch 2.11's Triton only; CI's CUDA-build venvs (torch 2.9.1, 2.14.1, 2.15.0) carry three other Triton releases, so
a release that stops compiling one of them fails here, not in a user's first training step. The interpreter tests
(``TRITON_INTERPRET=1``) check what the kernels compute; this one checks that the compiler takes them."""

import importlib

import pytest

from support.child_process import run_python, succeeded

COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cudnn_attention import fused_sinks, packed_rows

TYPES = {"out_ptr": "*bf16", "grad_ptr": "*bf16", "lse_ptr": "*fp32", "sinks_ptr": "*fp32", "absent_ptr": "*fp32",
         "terms_ptr": "*fp32", "cu_ptr": "*i32", "last": "i32"}
for i in range(3):
    TYPES.update({f"ptr{i}": "*bf16", f"rows{i}": "*u8", f"tokens{i}": "i32", f"value{i}": "fp32"})

def compiled(kernel, **constexprs):
    signature = {name: "constexpr" if name in constexprs else TYPES.get(name, "i32") for name in kernel.arg_names}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

built = []
for wide in (False, True):
    for absent in (False, True):
        built.append(compiled(fused_sinks._fold_kernel, HAS_ABSENT=absent, WIDE=wide, BLOCK_R=64, BLOCK_D=64))
    built.append(compiled(fused_sinks._sink_gradient_kernel, WIDE=wide, BLOCK_R=32, BLOCK_D=128))
for by_mask, count in ((True, 3), (False, 1)):
    widths = {"WIDTH0": 4096, "WIDTH1": 512, "WIDTH2": 512}
    built.append(compiled(packed_rows._fill_rows_kernel, **widths, COUNT=count, BY_MASK=by_mask, BLOCK_T=16, BLOCK_W=128))
assert all(kernel.asm["cubin"] for kernel in built)
print(f"triton {triton.__version__}: {len(built)} kernels compiled for sm_90")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds of torch ship it)")
def test_every_triton_kernel_compiles_for_sm90_without_a_gpu():
    assert "8 kernels compiled for sm_90" in succeeded(run_python(COMPILE, timeout=600))
