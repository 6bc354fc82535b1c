"""``cudnn-attention doctor``: the versions that matter, and a short self-check of each path on this GPU.

Each self-check runs one configuration (dense, padded, packed, window, sinks, and gpt-oss's packed window with
sinks) forward and backward in bfloat16 through the public functions, and compares the output and every gradient
with the exact path computed in float64 on the same inputs. The tolerance is the GPU tests' rule: the error may be
at most twice that of torch doing the same math in bfloat16, plus 1e-3 of the reference's largest magnitude. A
check passes when cuDNN served both directions and every tensor is within the rule; the exact path serving it
(named with its reason), a tensor outside the rule, or an error, fail it. ``stats()`` is read before and after each
check, never reset.

Exit status 0 only when every check passed: without a CUDA GPU nothing of cuDNN can be checked, so that is 1 too,
with one line saying so. The report also lists what is known to be wrong with the detected cuDNN version and what this
package does about each (:mod:`cudnn_attention.errata`), which of those a newer cuDNN fixes (with the command that
installs it), and notes a torch or transformers outside the tested ranges (:data:`cudnn_attention.environment.TESTED`).

This module is framework-free; ``--model`` (one forward and backward of a transformers model against eager) lives in
:mod:`cudnn_attention.integrations.hf.doctor_model` and reaches the report as extra checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple, TextIO

import torch

from . import environment, errata
from .api import attention, varlen_attention
from .masking import make_mask_spec
from .policy import CudnnAttentionFallbackWarning, stats, strict
from .reference import dense_reference, varlen_reference
from .tolerance import within_lowp_noise

__all__ = [
    "NO_GPU",
    "MEASURED_SPEED",
    "Check",
    "Report",
    "build_report",
    "known_issues",
    "main",
    "newer_cudnn_advice",
    "one_line",
    "path_taken",
    "quiet_fallbacks",
    "run_self_checks",
    "verdict",
]

NO_GPU = "no CUDA GPU: cuDNN paths cannot be checked"


def known_issues(cudnn_version: int | None) -> list[str]:
    """The :data:`cudnn_attention.errata.ERRATA` entries of this cuDNN version (``cudnn.backend_version()``; None:
    unknown, every entry), one paragraph each: what, which versions, who saw it, and what this package does."""
    return [f"{erratum.key}: {erratum.line()}" for erratum in errata.applying(cudnn_version)]


# Newer cuDNN versions as this project measured them against the one before (the kernel table, H200, bf16), so an upgrade
# is weighed by what it fixes and what it costs: (backend version, what was measured).
MEASURED_SPEED = (
    (92700, "9.27.0: fwd+bwd 0.80-1.02x 9.19's (slower at short shapes; docs/decisions/0015)"),
    (
        92801,
        "9.28.1: fwd+bwd 1.04-1.07x 9.19's packed, 1.01-1.03x dense at S >= 4096 (docs/decisions/0023); dense sink backward "
        "1.10x with a window (H100; dSink in the graph, 0025)",
    ),
)


def newer_cudnn_advice(cudnn_version: int | None, torch_cuda: str | None) -> list[str]:
    """Lines naming the errata of this cuDNN version that a newer cuDNN fixes, how the newer versions measured on an
    H200, and the command that installs one for this torch's CUDA (empty when none is fixed, or the version is unknown).
    This package works around each of them on the loaded version; upgrading removes the workaround's cost, not a wrong
    result."""
    if cudnn_version is None:
        return []
    fixed = [e for e in errata.applying(cudnn_version) if e.fixed is not None and e.affects is not None]
    if not fixed:
        return []
    newest = max(e.fixed for e in fixed)
    cuda_major = (torch_cuda or "13").split(".")[0]
    lines = [f"fixed in cuDNN {errata.version_text(e.fixed)} ({_who_found_the_fix(e)}; worked around here): {e.key}" for e in fixed]
    measured = [text for version, text in MEASURED_SPEED if version > cudnn_version]
    lines.append("speed on an H200: " + "; ".join([*measured, "later versions not measured here"]))
    lines += [
        f"to load a newer cuDNN with this torch: pip install -U 'nvidia-cudnn-cu{cuda_major}>={errata.version_text(newest)}'",
        "  pip prints an ERROR line, that torch requires the version it pins ('... which is incompatible'), and installs "
        "it all the same (exit status 0); torch and the frontend both load the upgraded library. A later pip install "
        "that resolves torch's requirements (accelerate, or this package with its dependencies) puts the pinned "
        "version back: upgrade cuDNN last, and run this doctor again, whose version lines say which one loads.",
    ]
    return lines


def _who_found_the_fix(erratum) -> str:
    # An upstream report names the fixed version; for this project's own findings it is the first version measured clean.
    return "upstream" if "http" in erratum.report else "measured clean here"


@dataclasses.dataclass
class Check:
    """One self-check's verdict.

    ``status``: ``"pass"`` (cuDNN served it, every tensor within the rule), ``"fallback"`` (the exact path served it,
    within the rule: correct, not on cuDNN), ``"fail"`` (a tensor outside the rule) or ``"error"`` (it raised).
    ``measurements``: tensor name -> ``(error, bound)``. ``served_by``: ``"cuDNN"``, ``"exact path"`` or ``"mixed"``.
    """

    name: str
    status: str
    served_by: str = ""
    fallback_reasons: list = dataclasses.field(default_factory=list)
    measurements: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        """One line: the verdict, the path, and the worst tensor against its bound (or the error)."""
        if self.error is not None:
            return self.error
        parts = [self.served_by] if self.served_by else []
        if self.fallback_reasons:
            parts.append("reasons: " + "; ".join(self.fallback_reasons))
        failing = [
            f"{name} error {error:.3g} > bound {bound:.3g}" for name, (error, bound) in self.measurements.items() if not error <= bound
        ]
        if failing:
            parts.append(", ".join(failing))
        elif self.measurements:
            name, (error, bound) = max(self.measurements.items(), key=lambda item: _ratio(*item[1]))
            parts.append(f"worst {name}: error {error:.3g} within bound {bound:.3g}")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def _ratio(error: float, bound: float) -> float:
    return math.inf if not error <= bound else (error / bound if bound > 0 else 0.0)


# ----------------------------------------------------------------------------------------------
# Self-checks
# ----------------------------------------------------------------------------------------------


class _Case(NamedTuple):
    name: str
    packed: bool = False
    padded: bool = False
    causal: bool = True
    window: tuple = (-1, -1)
    sinks: bool = False


# Sizes GPU training uses (D 128, GQA 8/2), small enough that the whole doctor runs in seconds; a 1-token document
# and a short padded row exercise the edges.
_CASES = (
    _Case("dense"),
    _Case("padded", padded=True),
    _Case("packed", packed=True),
    _Case("window", causal=False, window=(64, 0)),
    _Case("sinks", sinks=True),
    _Case("packed window sinks", packed=True, causal=False, window=(64, 0), sinks=True),
)
_BATCH, _HEADS, _KV_HEADS, _SEQ, _DIM = 2, 8, 2, 256, 128
_PADDED_LENGTHS = (256, 161)
_DOCUMENTS = (100, 1, 37, 118)


def _inputs(case: _Case, device, dtype) -> dict:
    """The case's tensors (float32 from a seeded CPU generator, so every machine checks the same numbers) in ``dtype``."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    if case.packed:
        tokens = sum(_DOCUMENTS)
        q, k, v = randn(tokens, _HEADS, _DIM), randn(tokens, _KV_HEADS, _DIM), randn(tokens, _KV_HEADS, _DIM)
        cu = torch.tensor([0, *torch.tensor(_DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32, device=device)
        lengths = {"cu_seqlens": cu, "max_seqlen": max(_DOCUMENTS)}
    else:
        q, k, v = randn(_BATCH, _HEADS, _SEQ, _DIM), randn(_BATCH, _KV_HEADS, _SEQ, _DIM), randn(_BATCH, _KV_HEADS, _SEQ, _DIM)
        lengths = {"seqlens": torch.tensor(_PADDED_LENGTHS, dtype=torch.int32, device=device)} if case.padded else {}
    tensors = {"q": q, "k": k, "v": v}
    if case.sinks:
        tensors["sinks"] = torch.randn(_HEADS, generator=generator).to(device=device, dtype=torch.float32)
    weights = torch.randn(*q.shape[:-1], _DIM, generator=generator).to(device)  # the loss's weights on the output
    return {"tensors": tensors, "lengths": lengths, "weights": weights}


def _loss_and_grads(out: torch.Tensor, leaves: dict, weights: torch.Tensor) -> dict:
    loss = (out.to(weights.dtype) * weights).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[name] for name in names])
    return {"out": out.detach(), **{f"d{name}": grad for name, grad in zip(names, grads)}}


def _leaves(tensors: dict, dtype=None) -> dict:
    return {name: (t if dtype is None else t.to(dtype)).detach().requires_grad_() for name, t in tensors.items()}


def _package_outputs(case: _Case, inputs: dict) -> dict:
    """Output and gradients from the package's public functions, as a user's call gets them."""
    leaves = _leaves(inputs["tensors"])
    q, k, v, sinks = leaves["q"], leaves["k"], leaves["v"], leaves.get("sinks")
    options = {"causal": case.causal, "window_size": case.window, "sinks": sinks, "scale": _DIM**-0.5}
    if case.packed:
        cu, longest = inputs["lengths"]["cu_seqlens"], inputs["lengths"]["max_seqlen"]
        out = varlen_attention(q, k, v, cu, cu, longest, longest, **options)
    else:
        seqlens = inputs["lengths"].get("seqlens")
        out = attention(q, k, v, seqlens_q=seqlens, seqlens_kv=seqlens, **options)
    return _loss_and_grads(out, leaves, inputs["weights"])


def _exact_outputs(case: _Case, inputs: dict, dtype: torch.dtype) -> dict:
    """Output and gradients from the exact path computed in ``dtype`` (float64: the reference; bfloat16: torch's own
    low-precision math, the rule's yardstick)."""
    leaves = _leaves(inputs["tensors"], dtype)
    mask = make_mask_spec(causal=case.causal, bottom_right=False, window_size=case.window)
    options = {"scale": _DIM**-0.5, "mask": mask, "sinks_H": leaves.get("sinks"), "compute_dtype": dtype}
    if case.packed:
        cu, longest = inputs["lengths"]["cu_seqlens"], inputs["lengths"]["max_seqlen"]
        out, _ = varlen_reference(leaves["q"], leaves["k"], leaves["v"], cu, cu, longest, longest, **options)
    else:
        seqlens = inputs["lengths"].get("seqlens")
        out, _ = dense_reference(leaves["q"], leaves["k"], leaves["v"], seqlens_q_B=seqlens, seqlens_kv_B=seqlens, **options)
    return _loss_and_grads(out, leaves, inputs["weights"].to(dtype))


def path_taken(before: dict, after: dict) -> tuple[str, list[str]]:
    """``(served_by, fallback reasons)`` of what ran between two :func:`cudnn_attention.stats` snapshots: ``"cuDNN"``
    when cuDNN served a forward and a backward and nothing fell back, ``"exact path"`` when it served neither both,
    ``"mixed"`` when some calls fell back beside cuDNN's."""
    reasons = sorted(
        {
            reason
            for direction in ("fallback_forward", "fallback_backward")
            for reason, count in after[direction].items()
            if count > before[direction].get(reason, 0)
        }
    )
    on_cudnn = after["cudnn_forward"] > before["cudnn_forward"] and after["cudnn_backward"] > before["cudnn_backward"]
    return ("mixed" if on_cudnn and reasons else ("cuDNN" if on_cudnn else "exact path")), reasons


def verdict(measurements: dict, served_by: str) -> str:
    """A check's status from its ``(error, bound)`` measurements and the path that served it (see :class:`Check`)."""
    if not all(error <= bound for error, bound in measurements.values()):
        return "fail"
    return "pass" if served_by == "cuDNN" else "fallback"


@contextlib.contextmanager
def quiet_fallbacks():
    """Fallbacks counted but neither raised nor warned about: the report names them, and a strict environment
    (``CUDNN_ATTENTION_STRICT=1``) must not turn the first one into an error that hides the rest."""
    with strict(False), warnings.catch_warnings():
        warnings.simplefilter("ignore", CudnnAttentionFallbackWarning)
        yield


def _run_package(case: _Case, inputs: dict) -> tuple[dict, str, list]:
    """``(outputs, served_by, fallback reasons)`` of the package on this case, read from ``stats()`` around the call."""
    before = stats()
    with quiet_fallbacks():
        outputs = _package_outputs(case, inputs)
    return (outputs, *path_taken(before, stats()))


def _self_check(case: _Case, device) -> Check:
    try:
        inputs = _inputs(case, device, torch.bfloat16)
        got, served_by, reasons = _run_package(case, inputs)
        ref = _exact_outputs(case, inputs, torch.float64)
        lowp = _exact_outputs(case, inputs, torch.bfloat16)
    except Exception as error:  # noqa: BLE001 - a check reports what went wrong instead of stopping the doctor
        return Check(case.name, "error", error=one_line(error))
    measurements = {name: within_lowp_noise(got[name], ref[name], lowp[name]) for name in ref}
    return Check(case.name, verdict(measurements, served_by), served_by=served_by, fallback_reasons=reasons, measurements=measurements)


def one_line(error: BaseException) -> str:
    """An error as a report line: its type and the first line of its message, at most 500 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def run_self_checks(*, device: str | torch.device = "cuda") -> list[Check]:
    """Every self-check on ``device`` (forward and backward, bfloat16, against the float64 exact path). On a CPU every
    one takes the exact path, which the checks then measure against itself at higher precision."""
    return [_self_check(case, torch.device(device)) for case in _CASES]


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """What the doctor found: versions, checks (the self-checks, then any extra ones), known issues, notes."""

    versions: dict
    checks: list
    known_issues: list
    newer_cudnn: list
    notes: list

    @property
    def exit_status(self) -> int:
        """0 only when there were checks and every one passed."""
        return 0 if self.checks and all(check.passed for check in self.checks) else 1

    def as_dict(self) -> dict:
        return {
            "versions": self.versions,
            "checks": [dataclasses.asdict(check) | {"passed": check.passed} for check in self.checks],
            "known_issues": self.known_issues,
            "newer_cudnn": self.newer_cudnn,
            "notes": self.notes,
            "exit_status": self.exit_status,
        }

    def format(self) -> str:
        width = max(len(key) for key in self.versions)
        lines = ["cudnn-attention doctor", "", "versions:"]
        lines += [f"  {key:<{width}}  {value}" for key, value in self.versions.items()]
        if self.checks:
            lines += ["", "checks (bfloat16, forward and backward, against the exact path in float64):"]
            name_width = max(len(check.name) for check in self.checks)
            lines += [f"  {check.status.upper():<8}  {check.name:<{name_width}}  {check.summary()}" for check in self.checks]
        cudnn = errata.version_text(self.versions.get("cudnn_backend"))
        lines += ["", f"known issues of cuDNN {cudnn}:" if cudnn else "known issues (cuDNN version unknown: all of them):"]
        lines += [f"  - {text}" for text in self.known_issues] or ["  none recorded"]
        if self.newer_cudnn:
            lines += ["", "a newer cuDNN:"] + [f"  {text}" for text in self.newer_cudnn]
        if self.notes:
            lines += [""] + self.notes
        passed = sum(check.passed for check in self.checks)
        lines += ["", f"{passed} of {len(self.checks)} checks passed; exit status {self.exit_status}"]
        return "\n".join(lines)


def _versions() -> dict:
    found = environment.versions()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        found["compute_capability"] = f"{major}.{minor}"
    return found


def build_report(
    *,
    device: str | torch.device | None = None,
    extra_checks: Callable[[torch.device], Iterable[Check]] | None = None,
    extra_checks_name: str = "the extra checks",
) -> Report:
    """The versions, the self-checks on ``device`` (None: the current CUDA GPU; without one no check runs and the
    report says so), then ``extra_checks(device)`` (the ``--model`` checks; ``extra_checks_name`` names them in the
    note that says they did not run), and the known issues."""
    found = _versions()
    notes, checks = [], []
    if device is None and not torch.cuda.is_available():
        notes.append(NO_GPU)
        if extra_checks is not None:
            notes.append(f"{extra_checks_name}: not checked ({NO_GPU})")
    else:
        device = torch.device("cuda") if device is None else torch.device(device)
        checks = run_self_checks(device=device)
        if extra_checks is not None:
            checks += list(extra_checks(device))
    notes += environment.untested_versions(found)
    cudnn = found.get("cudnn_backend")
    return Report(found, checks, known_issues(cudnn), newer_cudnn_advice(cudnn, found.get("cuda")), notes)


def main(
    *,
    as_json: bool = False,
    extra_checks: Callable[[torch.device], Iterable[Check]] | None = None,
    extra_checks_name: str = "the extra checks",
    stream: TextIO | None = None,
) -> int:
    """Print the report (text, or JSON with ``as_json``) to ``stream`` (default stdout); returns the exit status."""
    report = build_report(extra_checks=extra_checks, extra_checks_name=extra_checks_name)
    text = json.dumps(report.as_dict(), indent=2, default=str) if as_json else report.format()
    print(text, file=stream or sys.stdout)
    return report.exit_status
