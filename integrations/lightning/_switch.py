"""What the Lightning callbacks turn on and off, with no Lightning import: shared by both namespaces and Fabric.

:class:`AttentionSwitch` holds one activation: the provider (:func:`cudnn_attention.install`),
strict mode, and the Hugging Face models moved to ``attn_implementation="cudnn"`` (a
:class:`cudnn_attention.integrations.hf.ModelSwitch`, which remembers what to give back).
:class:`CudnnAttentionHooks` maps Lightning's hooks onto it; the ``CudnnAttention`` classes only add
the namespace's ``Callback`` base.

Each resource is given back only by the switch that took it: a provider another party installed
stays installed, a model another switch moved is left to that switch. That keeps nested and
duplicate switches (the env-var entry point next to an explicit callback) harmless.
"""

from __future__ import annotations

import contextlib
import logging

import cudnn_attention
from cudnn_attention import provider as _provider
from cudnn_attention.plan import device_unservable_reason as unservable_reason
from cudnn_attention.validation import check_flag

from ..hf.model_switch import ModelSwitch

__all__ = ["AttentionSwitch", "CudnnAttentionHooks", "fabric_attention"]

_log = logging.getLogger(__name__)

METRIC_PREFIX = "cudnn_attention/"


class AttentionSwitch:
    """One activation of cuDNN attention: :meth:`activate`, :meth:`switch_models` (repeatable), :meth:`deactivate`."""

    def __init__(self, *, strict: bool = False, provider: bool = True, hf_models: bool = True):
        self.strict = check_flag(strict, "strict")
        self.provider = check_flag(provider, "provider")
        self.hf_models = check_flag(hf_models, "hf_models")
        self._handle = None  # the provider handle, when this switch installed it
        self._strict_previous = None
        self._strict_held = False
        self._models = ModelSwitch()
        self._baseline: dict | None = None

    @property
    def active(self) -> bool:
        return self._baseline is not None

    def activate(self) -> None:
        """Install the provider and enter strict mode, as configured (idempotent)."""
        if self.active:
            return
        self._baseline = _flat_counts(cudnn_attention.stats())
        if self.strict:
            self._strict_previous = cudnn_attention.set_strict(True)
            self._strict_held = True
        if self.provider and _provider.current() is None:
            self._handle = cudnn_attention.install()

    def switch_models(self, module) -> int:
        """Move every Hugging Face model in ``module`` to ``"cudnn"``; returns how many models this switch holds."""
        if not self.hf_models:
            return 0
        # Re-applied at every stage start: a model built in configure_model, or one a user moved
        # in between, runs "cudnn" again for the next loop.
        return self._models.apply(module)

    def deactivate(self) -> None:
        """Give every model its previous implementation back, remove the provider and strict mode (idempotent)."""
        self._models.restore()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._strict_held:
            cudnn_attention.set_strict(self._strict_previous)
            self._strict_held = False
        self._baseline = None

    def counts(self) -> dict[str, float]:
        """Calls served since :meth:`activate`, flat and prefixed ``cudnn_attention/`` for a logger."""
        now = _flat_counts(cudnn_attention.stats())
        base = self._baseline or {}
        # max(0, ...): a reset_stats() in between restarts the counters.
        return {f"{METRIC_PREFIX}{key}": float(max(0, value - base.get(key, 0))) for key, value in now.items()}

    def __getstate__(self) -> dict:
        # ddp_spawn pickles callbacks into new processes: carry the options, never live handles.
        return {"strict": self.strict, "provider": self.provider, "hf_models": self.hf_models}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


class CudnnAttentionHooks:
    """Lightning hooks over an :class:`AttentionSwitch`; mixed into each namespace's ``Callback``.

    Args:
        strict: make every fallback from cuDNN raise :class:`cudnn_attention.StrictModeError` while
            the trainer runs (``cudnn_attention.set_strict(True)``; the previous setting comes back).
        provider: install :func:`cudnn_attention.install` (``F.scaled_dot_product_attention`` on
            the cuDNN backend and ``varlen_attn`` run on this project's ops).
        hf_models: switch every ``transformers.PreTrainedModel`` inside the LightningModule to
            ``attn_implementation="cudnn"`` at each fit/validate/test/predict start, and back after.
        log_stats: at each training epoch end, log the calls each path served since setup
            (``cudnn_attention/cudnn_forward``, ``.../fallback_forward``, ``.../provider_torch_forward``,
            ...) to the trainer's loggers, from rank zero.
    """

    def __init__(self, *, strict: bool = False, provider: bool = True, hf_models: bool = True, log_stats: bool = True):
        super().__init__()
        # Checked here, not only by the switch made at setup: strict="no" would read as true then, a fit later.
        self.strict = check_flag(strict, "strict")
        self.provider = check_flag(provider, "provider")
        self.hf_models = check_flag(hf_models, "hf_models")
        self.log_stats = check_flag(log_stats, "log_stats")
        self._switch: AttentionSwitch | None = None  # created in setup / on_after_setup, never pickled live

    # -- state --------------------------------------------------------------------------------

    def _activate(self) -> AttentionSwitch:
        if self._switch is None:
            self._switch = AttentionSwitch(strict=self.strict, provider=self.provider, hf_models=self.hf_models)
        self._switch.activate()
        return self._switch

    def deactivate(self) -> None:
        """Undo everything this callback turned on (what ``teardown`` and ``on_exception`` call; Fabric users call it themselves)."""
        if self._switch is not None:
            self._switch.deactivate()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_switch"] = None
        return state

    # -- Lightning Trainer hooks --------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Every rank, before the strategy wraps the model and before any compile trace.
        for other in trainer.callbacks:
            if other is self:
                break
            if isinstance(other, CudnnAttentionHooks):
                # e.g. CUDNN_ATTENTION=1 next to an explicit callback: one switch is enough.
                _log.info("cudnn_attention: another CudnnAttention callback runs first; this one stays inactive")
                return
        self._refuse_strict_where_cudnn_serves_nothing(trainer.strategy.root_device)
        self._activate()

    def _refuse_strict_where_cudnn_serves_nothing(self, device) -> None:
        """Strict mode where cuDNN can serve no call (a CPU Trainer, no frontend) would fail at the first attention call,
        deep inside the training step: say so before any work, with what to change."""
        if not (self.strict or cudnn_attention.is_strict()):
            return
        reason = unservable_reason(device)
        if reason is None:
            return
        if self.strict:
            asked, change = "CudnnAttention(strict=True)", "pass strict=False to train on the exact fallback"
        else:
            asked, change = "strict mode (CUDNN_ATTENTION_STRICT=1, or set_strict(True))", "unset it to train on the exact fallback"
        raise cudnn_attention.StrictModeError(
            f"{asked} turns every attention call cuDNN cannot serve into an error, and cuDNN serves no call here ({reason}: "
            f"the Trainer runs on {device}): {change}, or run on a GPU"
        )

    def _switch_models(self, pl_module) -> None:
        if self._switch is not None:
            self._switch.switch_models(pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._switch_models(pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._switch_models(pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._switch_models(pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._switch_models(pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.log_stats or self._switch is None or not trainer.is_global_zero:
            return
        metrics = self._switch.counts()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.deactivate()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning skips teardown hooks after an exception; this is the only chance to undo.
        self.deactivate()

    # -- Fabric -------------------------------------------------------------------------------

    def on_after_setup(self, fabric, module) -> None:
        """Fabric hook (``Fabric(callbacks=[CudnnAttention()])``, then ``fabric.setup(model)``): activate
        and switch the models in ``module``. Fabric has no teardown hook: call :meth:`deactivate`, or
        use :func:`fabric_attention` instead."""
        self._activate().switch_models(module)


@contextlib.contextmanager
def fabric_attention(module, *, strict: bool = False, provider: bool = True, hf_models: bool = True):
    """Context manager: cuDNN attention for ``module`` inside the block, everything restored after (also on error).

    Works with any ``torch.nn.Module`` (a Fabric-wrapped one included); the options are the
    callback's.

    Example:
        >>> model = fabric.setup(model)
        >>> with fabric_attention(model):
        ...     for batch in loader:
        ...         fabric.backward(model(**batch).loss)
    """
    switch = AttentionSwitch(strict=strict, provider=provider, hf_models=hf_models)
    switch.activate()
    try:
        switch.switch_models(module)
        yield switch
    finally:
        switch.deactivate()


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _flat_counts(stats: dict) -> dict[str, int]:
    served = stats["provider"]
    return {
        "cudnn_forward": stats["cudnn_forward"],
        "cudnn_backward": stats["cudnn_backward"],
        "fallback_forward": sum(stats["fallback_forward"].values()),
        "fallback_backward": sum(stats["fallback_backward"].values()),
        "provider_served_forward": served["sdpa_forward"] + served["varlen_forward"],
        "provider_served_backward": served["sdpa_backward"] + served["varlen_backward"],
        "provider_torch_forward": sum(served["torch_forward"].values()),
        "provider_torch_backward": sum(served["torch_backward"].values()),
        "graph_builds": stats["graph_builds"]["forward"] + stats["graph_builds"]["backward"],
    }
