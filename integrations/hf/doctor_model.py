"""``cudnn-attention doctor --model PATH_OR_CONFIG``: one forward and backward of the user's model on cuDNN against eager.

The model runs three times on the same random batch with the same weights: ``attn_implementation="cudnn"`` in
bfloat16 (what is checked), ``"eager"`` in bfloat16 (torch's own low-precision error, the rule's yardstick) and
``"eager"`` in float32 (the reference). The logits must be within the doctor's rule (twice eager bfloat16's largest
error plus 1e-3 of the largest logit); each parameter's gradient within the GPU tests' whole-model rule: relative
error over the whole tensor at most twice eager bfloat16's plus 1e-3 (one element's error swings with how every
other product rounds). Two batches: two dense rows, and one row of packed documents marked by ``position_ids``
(eager keeps documents apart when it finds them there, as the flash and cuDNN paths do).

A directory holding weights is loaded with them; a config (a ``config.json``, or a directory or hub id without
weights) gives a random model of its first layers: one of each attention type its ``layer_types`` declares, else
two. Memory: the model and its gradients in float32 on the device, two bfloat16 copies of the gradients in host
memory. Mixture-of-experts routing can flip under bfloat16 rounding in either implementation; eager's own flips
widen the bound accordingly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...doctor import Check, one_line, path_taken, quiet_fallbacks, verdict, within_lowp_noise
from ...policy import stats
from .registration import ATTN_IMPLEMENTATION, register

__all__ = ["load_model", "model_checks"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ROWS, _TOKENS = 2, 256
_DOCUMENTS = (100, 37, 119)


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
        model = AutoModelForCausalLM.from_pretrained(path_or_config, dtype=dtype, attn_implementation="eager").to(device)
        return model.eval(), f"{path_or_config}, pretrained weights"
    config = AutoConfig.from_pretrained(path_or_config)
    _few_layers(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval(), f"{path_or_config}, random weights, {config.num_hidden_layers} layers"


def _batches(config, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab = config.get_text_config().vocab_size
    dense = torch.randint(0, vocab, (_ROWS, _TOKENS), generator=generator)
    packed = torch.randint(0, vocab, (1, sum(_DOCUMENTS)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in _DOCUMENTS]).unsqueeze(0)
    return {
        "model dense": {"input_ids": dense.to(device)},
        "model packed": {"input_ids": packed.to(device), "position_ids": positions.to(device)},
    }


def _step(model, batch: dict, *, keep_on) -> tuple[torch.Tensor, dict]:
    """Logits and every parameter's gradient (moved to ``keep_on``, None: left where they are) of one forward and
    backward, the next-token loss on the batch itself."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, labels=batch["input_ids"], use_cache=False)
    out.loss.backward()
    grads = {
        name: p.grad.detach() if keep_on is None else p.grad.detach().to(keep_on)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` over the whole tensor (``||got||`` where the reference is zero)."""
    scale = ref.double().norm().item()
    difference = (got.double() - ref.double()).norm().item()
    return difference / scale if scale > 0 else got.double().norm().item()


def _gradient_measurements(cudnn: dict, eager: dict, reference: dict) -> dict:
    """Every parameter outside the rule, else the one nearest its bound, as ``name: (relative error, bound)``."""
    found = {}
    for parameter, want in reference.items():
        error = _relative_error(cudnn[parameter].to(want.device), want)
        base = _relative_error(eager[parameter].to(want.device), want)
        found[f"d {parameter} (relative)"] = (error, 2 * base + 1e-3)
    failing = {name: pair for name, pair in found.items() if not pair[0] <= pair[1]}
    if failing or not found:
        return failing
    nearest = max(found, key=lambda name: found[name][0] / found[name][1])
    return {nearest: found[nearest]}


def _check_batch(model, name: str, batch: dict, description: str) -> Check:
    model.to(torch.bfloat16)  # bfloat16 -> float32 -> bfloat16 is exact: every run has the same weights
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    before = stats()
    with quiet_fallbacks():
        logits, grads = _step(model, batch, keep_on="cpu")
    served_by, reasons = path_taken(before, stats())
    model.set_attn_implementation("eager")
    eager_logits, eager_grads = _step(model, batch, keep_on="cpu")
    model.to(torch.float32)
    ref_logits, ref_grads = _step(model, batch, keep_on=None)
    measurements = {"logits": within_lowp_noise(logits, ref_logits, eager_logits)}
    measurements.update(_gradient_measurements(grads, eager_grads, {p: g for p, g in ref_grads.items() if p in grads}))
    status, note = verdict(measurements, served_by), description
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
    for name, batch in batches.items():
        try:
            checks.append(_check_batch(model, name, batch, description))
        except Exception as error:  # noqa: BLE001
            checks.append(Check(name, "error", error=one_line(error), note=description))
    return checks
