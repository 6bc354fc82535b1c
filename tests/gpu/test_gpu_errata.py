"""The errata table (``cudnn_attention.errata``) against the loaded cuDNN, on the GPU.

Each reroute entry has a reproducer (the adversarial rows of ``support.adversarial``: every score of a row near -100, so its
log-sum-exp is below -88.7). With the package's workaround every gradient is finite and within the tolerance rule on every
version; with the workaround off, the reproducer must fail exactly on the versions the table calls affected, so a cuDNN
that fixes a bug (or one that brings it back) shows up here until its entry is changed. The one-query reproducer is
frontend issue 1072's, the 64-mod-128 one pytorch issue 196678's. A crash entry (1071) is never reproduced in-process.
"""

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_graphs, errata, graph_spec
from cudnn_attention.frontend import cudnn_version
from support.adversarial import anti_align
from support.reference64 import evaluate_call

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _dense_adversarial(S_q, S_kv, D, *, H=4, H_kv=2, B=1, target=100.0, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, H, S_q, D, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(B, H_kv, S_kv, D, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(B, H_kv, S_kv, D, device=DEVICE, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    anti_align(q, k, scale=D**-0.5, target=target + torch.tensor(float(S_kv)).log().item(), rows="all", generator=generator, packed=False)
    return [t.requires_grad_() for t in (q, k, v)]


MASKS = {"none": {}, "causal": dict(causal=True), "left window": dict(window_size=(100, -1)), "band": dict(window_size=(8, 300))}


@pytest.mark.parametrize("S", [64, 192, 320, 576, 1088, 128, 200, 1000])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
def test_negative_lse_rows_get_finite_gradients(S, D, mask):
    q, k, v = _dense_adversarial(S, S, D)
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        result = evaluate_call("dense", (q, k, v), MASKS[mask])
    assert cudnn_attention.stats()["cudnn_backward"] == 1
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]


@pytest.mark.parametrize("S_kv", [128, 576, 1000])
def test_a_single_negative_lse_query_gets_finite_gradients(S_kv):
    q, k, v = _dense_adversarial(1, S_kv, 64, H=2, H_kv=2, target=120.0)
    with cudnn_attention.strict():
        result = evaluate_call("dense", (q, k, v), {})
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]


REPRODUCERS = {
    # key: (S_q, S_kv, D, H, H_kv, target, the gradient the bug ruins)
    "dq-nan-kv-64-mod-128": (576, 576, 64, 4, 2, 100.0, 0),
    "dkdv-nan-single-query": (1, 128, 64, 2, 2, 122.0, 1),
}


@pytest.mark.parametrize("key", list(REPRODUCERS))
def test_the_table_matches_the_loaded_cudnn(key, monkeypatch):
    """With the reroute off, the reproducer's gradient is non-finite exactly where the table says the loaded cuDNN has the bug."""
    erratum = next(e for e in errata.ERRATA if e.key == key)
    affected = erratum.applies_to(cudnn_version())
    monkeypatch.setattr(graph_spec, "_around_errata", lambda spec: spec)
    cudnn_graphs.clear_cache()
    try:
        S_q, S_kv, D, H, H_kv, target, which = REPRODUCERS[key]
        q, k, v = _dense_adversarial(S_q, S_kv, D, H=H, H_kv=H_kv, target=target)
        out = cudnn_attention.attention(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        broken = not bool(torch.isfinite(grads[which]).all())
    finally:
        cudnn_graphs.clear_cache()
    version = errata.version_text(cudnn_version())
    said = "applies" if affected else "does not apply"
    assert broken == affected, f"cuDNN {version}: the table says {key} {said}, the reproducer says otherwise"


def test_the_rerouted_graph_is_the_padded_one_and_no_host_sync():
    from support.sync_debug import warm_and_run

    q, k, v = _dense_adversarial(576, 576, 64)
    grad = torch.randn(1, 4, 576, 64, device=DEVICE, dtype=torch.bfloat16)

    def step():
        out = cudnn_attention.attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)

    warm_and_run(step)  # warm-up, then under torch.cuda.set_sync_debug_mode("error")
    specs = [spec for spec in cudnn_graphs._cache if spec.direction == "backward" and spec.seq_kv == 576]
    assert len(specs) == 1
    rerouted = errata.matching(specs[0]._replace(padded=False), cudnn_version()) is not None
    assert specs[0].padded == rerouted  # padded exactly on the versions the table calls affected


def _past_the_grid_case(B, *, seed=0):
    # A vision model's windows folded into the batch, with options a chunk must carry: GQA, sinks, a padding mask and a
    # causal window, in transformers' (B, S, H, D) memory.
    torch.manual_seed(seed)
    q = torch.randn(B, 16, 2, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(B, 24, 1, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    sinks = torch.randn(2, device=DEVICE)
    seqlens_kv = torch.randint(0, 25, (B,), device=DEVICE, dtype=torch.int32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    return leaves[:3], dict(sinks=leaves[3], seqlens_kv=seqlens_kv, causal=True, window_size=(8, 0))


@pytest.mark.parametrize("B, chunks", [(65535, 1), (65536, 2), (140000, 3)], ids=["the limit", "one past it", "three chunks"])
def test_batches_past_the_grid_limit_are_served_in_chunks(B, chunks):
    """Past 65,535 (entry batch-or-heads-over-65535) a dense call runs on cuDNN as batch chunks that each fit, within the
    rule against float64, forward and backward, dSink summed over the chunks: what a small batch of the same call does,
    once per chunk, with nothing falling back."""
    small_qkv, small_options = _past_the_grid_case(4)
    cudnn_attention.reset_stats()
    assert evaluate_call("dense", tuple(small_qkv), small_options)["ok"]
    small = cudnn_attention.stats()
    assert small["cudnn_forward"] == small["cudnn_backward"] == 1, small
    qkv, options = _past_the_grid_case(B)
    cudnn_attention.reset_stats()
    result = evaluate_call("dense", tuple(qkv), options)
    stats = cudnn_attention.stats()
    assert result["ok"], (B, [c for c in result["checks"] if not c["ok"]])
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == chunks, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats


def test_heads_past_the_grid_limit_take_the_exact_path():
    """65,536 heads cannot be chunked by batch: the graph is refused before a build and the exact path serves the call
    within the rule, said so."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 65536, 4, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cudnn_attention.reset_stats()
    result = evaluate_call("dense", (q, k, v), {})
    stats = cudnn_attention.stats()
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == 0, stats
    assert all("batch-or-heads-over-65535" in reason for reason in stats["fallback_forward"]), stats


# The graph the entry refuses, built and launched anyway in a fresh process (a launch that fails may leave the CUDA
# context unusable): it must fail exactly where the table says the loaded cuDNN has the limit.
_PAST_THE_GRID = """
import torch, cudnn_attention
from cudnn_attention import errata
errata.ERRATA = tuple(e for e in errata.ERRATA if e.key != "batch-or-heads-over-65535")
torch.manual_seed(0)
q, k, v = (torch.randn(65536, 1, 16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
step = "forward"
try:
    with cudnn_attention.strict():
        out = cudnn_attention.attention(q, k, v)
        torch.cuda.synchronize()
        step = "backward"
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    torch.cuda.synchronize()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = torch.softmax((leaves[0] @ leaves[1].transpose(-1, -2)) * 32**-0.5, -1) @ leaves[2]
    refs = (ref, *torch.autograd.grad(ref.square().sum(), leaves))
    errs = [(got.float() - want).abs().max().item() for got, want in zip((out, *grads), refs)]
    print("ran", "right" if max(errs) < 0.1 else f"wrong {errs}")
except Exception as exc:
    print("failed in the", step, type(exc).__name__, str(exc)[:200].replace("\\n", " "))
"""


def test_the_grid_limit_matches_the_loaded_cudnn():
    from support.child_process import run_python

    erratum = next(e for e in errata.ERRATA if e.key == "batch-or-heads-over-65535")
    result = run_python(_PAST_THE_GRID, timeout=300)
    said = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else f"exit {result.returncode}: {result.stderr[-500:]}"
    served = said.startswith("ran right")
    version = errata.version_text(cudnn_version())
    assert served != erratum.applies_to(cudnn_version()), (
        f"cuDNN {version}: the table says the grid limit applies; B 65,536 forward and backward: {said}"
    )
