"""``cudnn-attention doctor --model PATH_OR_CONFIG``: one forward and backward of the user's model on cuDNN against eager.

The model runs three times on the same random batch with the same weights: ``attn_implementation="cudnn"`` in
bfloat16 (what is checked), ``"eager"`` in bfloat16 (torch's own low-precision error, the rule's yardstick) and
``"eager"`` in float32 (the reference). The logits must be within the doctor's rule (twice eager bfloat16's largest
error plus 1e-3 of the largest logit); the gradients, every parameter's as one vector, within the GPU tests'
whole-tensor rule: relative error at most twice eager bfloat16's plus 1e-3 (see :func:`_gradient_measurements`). The
loss is the next-token cross-entropy inside each document, summed. Two batches: two dense rows, and one row of packed
documents marked by ``position_ids`` (the way transformers' padding-free collator marks them), which eager runs document
by document: not every model's eager keeps packed documents apart.

A directory holding weights is loaded with them; a config (a ``config.json``, or a directory or hub id without
weights) gives a random model of its first layers: one of each attention type its ``layer_types`` declares, else
two. Memory: the model and its gradients in float32 on the device, two bfloat16 copies of the gradients in host
memory. Mixture-of-experts routing can flip under bfloat16 rounding in either implementation; eager's own flips
widen the bound accordingly.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...doctor import Check, one_line, path_taken, quiet_fallbacks, verdict
from ...policy import stats
from ...tolerance import within_lowp_noise
from . import _compat
from .registration import ATTN_IMPLEMENTATION, register

__all__ = ["load_model", "model_checks", "model_source_problem"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ROWS, _TOKENS = 2, 256
_DOCUMENTS = (100, 37, 119)


# What the Hub takes for a repository id (huggingface_hub's validate_repo_id): "name" or "namespace/name".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_source_problem(path_or_config: str) -> str | None:
    """Why ``--model path_or_config`` can name no model, before anything loads (None: it may): a path that does not
    exist and cannot be a hub id either, such as ``/no/such/model``. A hub-id-shaped name is left to the loader: whether
    the Hub has it is not known offline."""
    if Path(path_or_config).exists() or (_HUB_ID.fullmatch(path_or_config) and ".." not in path_or_config):
        return None
    return (
        f"--model {path_or_config}: no such file or directory, and not a hub id (namespace/name): pass a checkpoint "
        "directory, a config.json or a hub id"
    )


def _few_layers(config) -> None:
    """Keep the first layers of ``config``: up to one of each type in ``layer_types``, else two."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return
    types = getattr(config, "layer_types", None)
    keep = min(max(types.index(kind) for kind in set(types)) + 1 if types else 2, layers)
    config.num_hidden_layers = keep
    if types:
        config.layer_types = list(types[:keep])


def load_model(path_or_config: str, *, device, dtype=torch.bfloat16):
    """``(model, description)``: the pretrained model when ``path_or_config`` is a directory holding weights, else a
    random model of the config's first layers, on ``device`` in ``dtype``, in eval mode (no dropout: the three runs
    must compute the same function)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    path = Path(path_or_config)
    if path.is_dir() and any((path / name).exists() for name in _WEIGHT_FILES):
        # Without hub kernels: the three runs differ in attention alone (see _compat.without_hub_kernels).
        model = AutoModelForCausalLM.from_pretrained(
            path_or_config, dtype=dtype, attn_implementation="eager", **_compat.without_hub_kernels()
        ).to(device)
        return model.eval(), f"{path_or_config}, pretrained weights"
    config = AutoConfig.from_pretrained(path_or_config)
    _few_layers(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval(), f"{path_or_config}, random weights, {config.num_hidden_layers} layers"


class _Run(NamedTuple):
    """One forward: the model's inputs, and where each document lies in every row (next-token loss inside each)."""

    inputs: dict
    spans: tuple


def _batches(config, device) -> dict:
    """check name -> implementation kind (``"cudnn"``, ``"eager"``) -> the forwards of one step. Eager runs packed
    documents one by one: not every model's eager keeps documents apart by their ``position_ids`` (gpt-oss's builds its
    masks without them in transformers 5.17), and the cuDNN path must be compared with attention inside documents."""
    generator = torch.Generator().manual_seed(0)
    vocab = config.get_text_config().vocab_size
    dense = torch.randint(0, vocab, (_ROWS, _TOKENS), generator=generator).to(device)
    packed = torch.randint(0, vocab, (1, sum(_DOCUMENTS)), generator=generator).to(device)
    starts = [0, *itertools.accumulate(_DOCUMENTS)]
    spans = tuple(itertools.pairwise(starts))
    positions = torch.cat([torch.arange(n) for n in _DOCUMENTS]).unsqueeze(0).to(device)
    dense_runs = [_Run({"input_ids": dense}, ((0, _TOKENS),))]
    return {
        "model dense": {"cudnn": dense_runs, "eager": dense_runs},
        "model packed": {
            "cudnn": [_Run({"input_ids": packed, "position_ids": positions}, spans)],
            "eager": [_Run({"input_ids": packed[:, start:end]}, ((0, end - start),)) for start, end in spans],
        },
    }


def _step(model, runs: list, *, keep_on) -> tuple[torch.Tensor, dict]:
    """Logits (every row's tokens in order, flattened to (tokens, vocab)) and every parameter's gradient (moved to
    ``keep_on``; None: left where they are) of one step: the runs' next-token losses inside each document, summed."""
    model.zero_grad(set_to_none=True)
    total, logits_parts = 0.0, []
    for run in runs:
        logits = model(**run.inputs, use_cache=False).logits
        ids = run.inputs["input_ids"]
        for row in range(ids.shape[0]):
            for start, end in run.spans:
                total = total + F.cross_entropy(logits[row, start : end - 1].float(), ids[row, start + 1 : end], reduction="sum")
        logits_parts.append(logits.detach().flatten(0, 1))
    total.backward()
    grads = {
        name: p.grad.detach() if keep_on is None else p.grad.detach().to(keep_on)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return torch.cat(logits_parts), grads


def _gradient_measurements(cudnn: dict, eager: dict, reference: dict) -> tuple[tuple[float, float], str]:
    """The gradients' ``(relative error, bound)`` over the whole model (every parameter's gradient as one vector), and
    a line naming the parameter nearest its own bound.

    The whole model, not each parameter: a small tensor whose gradient is mostly cancellation (a router's bias) swings
    by more than twice eager's error with nothing wrong, where a wrong attention backward moves every gradient below
    it by far more (a wrong dQ made the GPU tests' embedding gradient 10 to 20 times eager's error). dSink, too small
    to move the whole, is checked by the self-checks' sink cases."""
    squares = {"reference": 0.0, "cudnn": 0.0, "eager": 0.0}
    nearest = ("", 0.0, 0.0, -1.0)
    for parameter, want in reference.items():
        want = want.double()
        norms = {
            name: (grads[parameter].to(want.device).double() - want).norm().item() for name, grads in (("cudnn", cudnn), ("eager", eager))
        }
        scale = want.norm().item()
        squares["reference"] += scale**2
        squares["cudnn"] += norms["cudnn"] ** 2
        squares["eager"] += norms["eager"] ** 2
        if scale > 0:
            error, bound = norms["cudnn"] / scale, 2 * norms["eager"] / scale + 1e-3
            if error / bound > nearest[3]:
                nearest = (parameter, error, bound, error / bound)
    scale = squares["reference"] ** 0.5 or 1.0
    whole = (squares["cudnn"] ** 0.5 / scale, 2 * squares["eager"] ** 0.5 / scale + 1e-3)
    return whole, f"parameter nearest its own bound: {nearest[0]} {nearest[1]:.3g} against {nearest[2]:.3g}"


def _check_batch(model, name: str, runs: dict, description: str) -> Check:
    model.to(torch.bfloat16)  # bfloat16 -> float32 -> bfloat16 is exact: every run has the same weights
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    before = stats()
    with quiet_fallbacks():
        logits, grads = _step(model, runs["cudnn"], keep_on="cpu")
    served_by, reasons = path_taken(before, stats())
    model.set_attn_implementation("eager")
    eager_logits, eager_grads = _step(model, runs["eager"], keep_on="cpu")
    model.to(torch.float32)
    ref_logits, ref_grads = _step(model, runs["eager"], keep_on=None)
    whole, nearest = _gradient_measurements(grads, eager_grads, {p: g for p, g in ref_grads.items() if p in grads})
    measurements = {"logits": within_lowp_noise(logits, ref_logits, eager_logits), "gradients (relative, whole model)": whole}
    status, note = verdict(measurements, served_by), f"{description}; {nearest}"
    missing = sorted(set(ref_grads) ^ set(grads))
    if missing:  # a parameter cuDNN's run gave no gradient, or eager's none: wrong whatever the figures say
        status, note = "fail", f"{description}; a gradient on one side only: {', '.join(missing[:5])}"
    return Check(name, status, served_by=served_by, fallback_reasons=reasons, measurements=measurements, note=note)


def model_checks(path_or_config: str, *, device) -> list:
    """One :class:`~cudnn_attention.doctor.Check` per batch (``"model dense"``, ``"model packed"``), or one ``"model"``
    check holding the error when the model cannot be loaded; a batch that raises is an ``"error"`` check of its own."""
    try:
        model, description = load_model(path_or_config, device=device)
        batches = _batches(model.config, device)
    except Exception as error:  # noqa: BLE001 - the report says what went wrong instead of stopping the doctor
        return [Check("model", "error", error=one_line(error))]
    checks = []
    for name, runs in batches.items():
        try:
            checks.append(_check_batch(model, name, runs, description))
        except Exception as error:  # noqa: BLE001
            checks.append(Check(name, "error", error=one_line(error), note=description))
    return checks
