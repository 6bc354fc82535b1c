"""Moving Hugging Face models to ``attn_implementation="cudnn"`` for a while, and giving each its implementation back.

For code that receives a model it did not build (a ``Trainer`` subclass, a training loop, a Lightning or Fabric
callback): :func:`switch_to_cudnn` moves every ``transformers.PreTrainedModel`` inside a module, and the
:class:`ModelSwitch` it returns restores them. The Lightning callbacks run on the same switch.
"""

from __future__ import annotations

import sys
import warnings
import weakref

import torch

from . import _compat
from .registration import ATTN_IMPLEMENTATION, register

__all__ = ["ModelSwitch", "switch_to_cudnn"]

# model -> the implementation it had before a switch moved it. One table for every switch, so that a second
# switch over the same model never records "cudnn" as its previous implementation.
_previous: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ModelSwitch:
    """Holds the Hugging Face models it moved to ``"cudnn"`` and what each ran before.

    :meth:`apply` is repeatable (a model built since, or moved back by someone else in between, runs
    ``"cudnn"`` again); :meth:`restore` gives every model it holds its previous implementation back. A model
    another switch already holds is left to that switch, so nested and duplicate switches are harmless. Also a
    context manager (restores on exit, errors included).

    Example:
        >>> switch = ModelSwitch()
        >>> switch.apply(model)     # every PreTrainedModel inside ``model``, composite models included
        1
        >>> trainer.train()
        >>> switch.restore()        # each model back on what it ran before ("sdpa", "eager", ...)
    """

    def __init__(self) -> None:
        self._models: list[weakref.ref] = []

    @property
    def models(self) -> list:
        """The models this switch holds (alive ones), outermost first as found."""
        return [model for model in (ref() for ref in self._models) if model is not None]

    def apply(self, module) -> int:
        """Move every Hugging Face model in ``module`` (itself included) to ``"cudnn"``; returns how many this switch holds.

        Registers ``"cudnn"`` with transformers first. Imports nothing when transformers is not imported (then
        no Hugging Face model can exist), so Lightning users without transformers pay nothing. ``module`` must be a
        ``torch.nn.Module``: anything else (a ``Trainer``, a model's name) raises ``TypeError`` naming it.
        """
        _check_is_module(module)
        if "transformers" not in sys.modules:
            return len(self._models)
        from transformers import PreTrainedModel

        register()
        for model in _outermost(module, PreTrainedModel):
            if model not in _previous:
                _previous[model] = _compat.attn_implementation_of(model)
                self._models.append(weakref.ref(model))
            elif not any(ref() is model for ref in self._models):
                continue  # another switch holds it and will give it back
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return len(self._models)

    def restore(self) -> None:
        """Give every model this switch holds its previous implementation back, latest first (idempotent)."""
        for ref in reversed(self._models):
            model = ref()
            if model is not None and model in _previous:
                model.set_attn_implementation(_previous.pop(model))
        self._models = []

    def __enter__(self) -> ModelSwitch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()


def switch_to_cudnn(module) -> ModelSwitch:
    """Move every Hugging Face model inside ``module`` to ``attn_implementation="cudnn"`` now; the returned
    :class:`ModelSwitch` gives them back (``restore()``, or leave a ``with`` block).

    ``module`` is any ``torch.nn.Module``: a ``PreTrainedModel``, a wrapper holding one (a LightningModule, a
    DDP/FSDP or Fabric wrapper), or a composite model (each sub-model is restored to its own implementation).

    Example:
        >>> from cudnn_attention.integrations.hf import switch_to_cudnn
        >>> with switch_to_cudnn(model):  # "cudnn" inside the block
        ...     trainer.train()
        >>> # each model runs what it ran before again ("sdpa", "eager", ...)
    """
    switch = ModelSwitch()
    if not switch.apply(module) and not _holds_hf_model(module):
        # A model another switch holds is no mistake; a module with none inside switches nothing, which would pass
        # unnoticed until the run turns out not to have used cuDNN.
        warnings.warn(
            f"switch_to_cudnn(): no Hugging Face model (transformers.PreTrainedModel) inside the {type(module).__name__} given, so "
            "nothing was switched: pass the module that holds the transformers model, or, for a model that calls "
            "F.scaled_dot_product_attention itself, use cudnn_attention.install()",
            UserWarning,
            stacklevel=2,
        )
    return switch


def _check_is_module(module) -> None:
    if isinstance(module, torch.nn.Module):
        return
    kind = type(module)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    inner = getattr(module, "model", None)
    if isinstance(inner, torch.nn.Module):  # a transformers Trainer, an accelerate or Lightning object holding one
        owner = "trainer" if kind.__name__.endswith("Trainer") else "obj"
        hint = f"pass its model, switch_to_cudnn({owner}.model)"
    else:
        hint = "pass the model (a transformers PreTrainedModel, or any module holding one)"
    raise TypeError(f"switch_to_cudnn() takes a torch.nn.Module holding Hugging Face models, got a {name}: {hint}")


def _holds_hf_model(module) -> bool:
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return any(isinstance(m, PreTrainedModel) for m in module.modules())


def _outermost(module, model_type) -> list:
    """Instances of ``model_type`` in ``module`` that are not inside another one: transformers propagates
    ``set_attn_implementation`` to a model's own sub-models, and restores them from the outer one's dict."""
    found = [m for m in module.modules() if isinstance(m, model_type)]
    inner = {id(sub) for model in found for sub in model.modules() if sub is not model}
    return [model for model in found if id(model) not in inner]
