"""Every touch of a private transformers API, in one place (the core's :mod:`cudnn_attention._compat` holds torch's
and the cuDNN frontend's).

Each function names the private attribute it reaches, the versions it was checked against, and what replaces it
when it moves. Nothing here imports transformers: each takes the object to act on as an argument.
"""

from __future__ import annotations

__all__ = ["attn_implementation_of", "unregister_interface_entry", "without_hub_kernels"]


def attn_implementation_of(model) -> str | dict | None:
    """What ``model.set_attn_implementation`` needs to give a transformers model its current implementation
    back: a string, or for a composite model a dict with ``""`` for the top level and one entry per sub-config.

    ``PreTrainedConfig._attn_implementation``: checked against transformers 5.17-5.25, which have a public
    setter (``set_attn_implementation``) but no public getter. When it moves, read the config's
    ``attn_implementation`` if one appears."""
    config = model.config
    parts = {}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            parts[key] = sub._attn_implementation
    return {"": config._attn_implementation, **parts} if parts else config._attn_implementation


def unregister_interface_entry(interface: type, name: str) -> None:
    """Remove ``name`` from a transformers interface class (``AttentionInterface``, ``AttentionMaskInterface``)
    for every model, undoing its ``register(name, ...)``; nothing happens when it is absent.

    ``GeneralInterface._global_mapping`` (the class-wide dict ``register`` writes): checked against transformers
    5.17-5.25, which have no public way to remove an entry. When it moves, use the removal transformers adds."""
    interface._global_mapping.pop(name, None)


def without_hub_kernels() -> dict:
    """The ``from_pretrained`` keyword arguments that load a model without transformers' hub kernels (the ``kernels``
    package's builds of RMSNorm, rotary and activation layers, fetched from the Hub for a GPU): ``{"use_kernels": False}``.

    A version touch, not a private one: ``use_kernels`` is public from 5.17 (default False) to 5.25, where ``kernels``
    became a dependency and the default True (``USE_HUB_KERNELS=NO`` turns it off process-wide). Where a comparison loads
    models, every implementation must run the same other kernels. When the argument moves, pass what replaces it here."""
    return {"use_kernels": False}
