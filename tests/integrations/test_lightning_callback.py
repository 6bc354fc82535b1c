"""The Lightning callback on CPU: LightningCLI flag, restore on teardown and on exception, entry points, pickling, Fabric.

On CPU the HF "cudnn" attention runs the exact fallback (counted as "cpu tensors"): what is tested
here is the switching, not the kernel. tests/test_gpu_provider.py fits on a GPU.
"""

import pickle

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

import cudnn_attention
from cudnn_attention import provider
from cudnn_attention.integrations.hf import _compat
from cudnn_attention.integrations.lightning import CudnnAttention, fabric_attention, factory
from support.lightning_models import TinyLlamaModule, tiny_llama

LAYERS, STEPS = 2, 2
FLAG = "--trainer.callbacks+=cudnn_attention.integrations.lightning.CudnnAttention"


@pytest.fixture(autouse=True)
def _no_flags_from_the_environment(monkeypatch):
    # The provider and strict mode left on after a test: conftest's _nothing_left_on.
    monkeypatch.delenv(factory.ENV_VAR, raising=False)
    monkeypatch.delenv("CUDNN_ATTENTION_STRICT", raising=False)


def _trainer_options(tmp_path, **overrides):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": STEPS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        "num_sanity_val_steps": 0,
    }
    options.update(overrides)
    return options


def _cli(tmp_path, *extra):
    from lightning.pytorch.cli import LightningCLI

    args = [
        "fit",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.max_steps={STEPS}",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        *extra,
    ]
    return LightningCLI(TinyLlamaModule, save_config_callback=None, args=args)


# ----------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------


def test_cli_flag_runs_hf_model_on_cudnn_inside_training_step_and_restores(tmp_path):
    cli = _cli(tmp_path, FLAG)
    model = cli.model
    assert any(isinstance(callback, CudnnAttention) for callback in cli.trainer.callbacks)
    assert model.seen_implementations == ["cudnn"] * STEPS
    assert model.seen_provider == [True] * STEPS
    assert model.initial_implementation == "sdpa" and _compat.attn_implementation_of(model.hf) == "sdpa"
    for layer in model.hf.model.layers:  # the implementation is read per call from the shared config
        assert _compat.attn_implementation_of(layer.self_attn) == "sdpa"
    stats = cudnn_attention.stats()
    # Every attention call of every step went through the "cudnn" function (on CPU: its exact fallback).
    assert stats["cudnn_forward"] + sum(stats["fallback_forward"].values()) == LAYERS * STEPS


def test_cli_init_args_select_what_is_switched(tmp_path):
    cli = _cli(
        tmp_path, FLAG, "--trainer.callbacks.hf_models=false", "--trainer.callbacks.provider=false", "--trainer.callbacks.log_stats=false"
    )
    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, CudnnAttention))
    assert (callback.hf_models, callback.provider, callback.log_stats) == (False, False, False)
    assert cli.model.seen_implementations == ["sdpa"] * STEPS and cli.model.seen_provider == [False] * STEPS


@pytest.mark.parametrize("flag", ["strict", "provider", "hf_models", "log_stats"])
def test_a_flag_that_is_not_a_bool_is_refused_at_construction(flag):
    # strict="no" read as true, and stopped the first fallback of a fit started much later.
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'no' \(str\)"):
        CudnnAttention(**{flag: "no"})
    if flag != "log_stats":
        with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 0 \(int\)"):
            fabric_attention(torch.nn.Linear(1, 1), **{flag: 0}).__enter__()


def test_strict_where_cudnn_serves_nothing_stops_before_training_in_one_line(tmp_path):
    # A CPU Trainer with strict=True once died at the first training step, in a 155-line traceback.
    model = TinyLlamaModule()
    trainer = Trainer(callbacks=[CudnnAttention(strict=True)], **_trainer_options(tmp_path))
    expected = (
        r"CudnnAttention\(strict=True\) .* cuDNN serves no call here \(cpu tensors: the Trainer runs on cpu\): "
        r"pass strict=False .* or run on a GPU"
    )
    with pytest.raises(cudnn_attention.StrictModeError, match=expected) as raised:
        trainer.fit(model)
    assert "\n" not in str(raised.value)
    assert model.seen_implementations == []  # before any step
    assert _compat.attn_implementation_of(model.hf) == "sdpa"


def test_strict_from_the_environment_is_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv(factory.ENV_VAR, "1")
    monkeypatch.setenv("CUDNN_ATTENTION_STRICT", "1")
    model = TinyLlamaModule()
    with pytest.raises(cudnn_attention.StrictModeError, match=r"\(CUDNN_ATTENTION_STRICT=1, or set_strict\(True\)\) .*: unset it"):
        Trainer(**_trainer_options(tmp_path)).fit(model)
    assert model.seen_implementations == []


def test_exception_path_restores_model_provider_and_strict(tmp_path, monkeypatch):
    # cuDNN "serves" this CPU Trainer as far as the setup check can tell, so strict mode is on when the first attention call
    # falls back: the run dies inside training_step.
    from cudnn_attention.integrations.lightning import _switch

    monkeypatch.setattr(_switch, "unservable_reason", lambda device: None)
    model = TinyLlamaModule()
    trainer = Trainer(callbacks=[CudnnAttention(strict=True)], **_trainer_options(tmp_path))
    with pytest.raises(cudnn_attention.StrictModeError, match="cpu tensors"):
        trainer.fit(model)
    assert model.seen_implementations == ["cudnn"] and model.seen_provider == [True]
    assert _compat.attn_implementation_of(model.hf) == "sdpa"
    # The fixture checks that the provider and strict mode are off again.


def test_existing_installation_and_duplicate_callbacks_are_left_alone(tmp_path):
    outer = cudnn_attention.install()
    try:
        model = TinyLlamaModule()
        trainer = Trainer(callbacks=[CudnnAttention(), CudnnAttention()], **_trainer_options(tmp_path))
        trainer.fit(model)
        assert model.seen_implementations == ["cudnn"] * STEPS
        assert _compat.attn_implementation_of(model.hf) == "sdpa"  # not "cudnn" recorded by a second switch
        assert outer.active and provider.current() is outer  # the callback did not install it, so it keeps it
    finally:
        outer.remove()


class _RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.logged: list[tuple[dict, int]] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_counts_are_logged_at_train_epoch_end(tmp_path):
    logger = _RecordingLogger()
    model = TinyLlamaModule()
    trainer = Trainer(
        callbacks=[CudnnAttention()], **_trainer_options(tmp_path, logger=logger, max_steps=-1, max_epochs=1, limit_train_batches=STEPS)
    )
    trainer.fit(model)
    ours = [metrics for metrics, _ in logger.logged if "cudnn_attention/fallback_forward" in metrics]
    assert len(ours) == 1
    assert ours[0]["cudnn_attention/fallback_forward"] == LAYERS * STEPS
    assert ours[0]["cudnn_attention/fallback_backward"] == LAYERS * STEPS
    assert ours[0]["cudnn_attention/provider_served_forward"] == 0
    assert ours[0]["cudnn_attention/graph_builds"] == 0  # the CPU fallback builds no cuDNN graph


# ----------------------------------------------------------------------------------------------
# The "trainer flag" (entry points)
# ----------------------------------------------------------------------------------------------


def test_factory_adds_the_callback_only_when_requested(monkeypatch):
    assert factory.callbacks() == [] and factory.pytorch_lightning_callbacks() == []
    monkeypatch.setenv(factory.ENV_VAR, "0")
    assert factory.callbacks() == []
    monkeypatch.setenv(factory.ENV_VAR, "1")
    (callback,) = factory.callbacks()
    assert isinstance(callback, CudnnAttention)


def test_entry_point_reaches_every_trainer_only_when_requested(monkeypatch, tmp_path):
    from importlib.metadata import entry_points

    if not any(
        ep.value == "cudnn_attention.integrations.lightning.factory:callbacks"
        for ep in entry_points(group="lightning.pytorch.callbacks_factory")
    ):
        pytest.fail("entry point not installed: run `pip install --no-build-isolation --no-deps -e .`")
    options = _trainer_options(tmp_path)
    assert not any(isinstance(cb, CudnnAttention) for cb in Trainer(**options).callbacks)
    monkeypatch.setenv(factory.ENV_VAR, "1")
    assert sum(isinstance(cb, CudnnAttention) for cb in Trainer(**options).callbacks) == 1


def test_pytorch_lightning_namespace_gets_its_own_class(monkeypatch, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from lightning.pytorch import Callback

    from cudnn_attention.integrations.lightning.pytorch_lightning import CudnnAttention as PLCudnnAttention

    assert issubclass(PLCudnnAttention, pl.Callback) and not issubclass(PLCudnnAttention, Callback)
    monkeypatch.setenv(factory.ENV_VAR, "1")
    callbacks = pl.Trainer(**_trainer_options(tmp_path)).callbacks
    assert sum(isinstance(cb, PLCudnnAttention) for cb in callbacks) == 1
    assert not any(isinstance(cb, CudnnAttention) for cb in callbacks)


# ----------------------------------------------------------------------------------------------
# Pickling and Fabric
# ----------------------------------------------------------------------------------------------


def test_callback_pickles_before_and_while_active():
    callback = CudnnAttention(strict=True, hf_models=False, log_stats=False)
    clone = pickle.loads(pickle.dumps(callback))
    assert (clone.strict, clone.provider, clone.hf_models, clone.log_stats) == (True, True, False, False)
    callback.on_after_setup(fabric=None, module=torch.nn.Linear(2, 2))  # live: a provider handle inside
    try:
        clone = pickle.loads(pickle.dumps(callback))
        assert clone._switch is None and provider.current() is not None
    finally:
        callback.deactivate()


def test_fabric_callback_and_context_manager(tmp_path):
    from lightning.fabric import Fabric

    hf = tiny_llama()
    callback = CudnnAttention()
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[callback])
    wrapped = fabric.setup(hf)
    assert _compat.attn_implementation_of(hf) == "cudnn" and provider.current() is not None
    callback.deactivate()  # Fabric has no teardown hook
    assert _compat.attn_implementation_of(hf) == "sdpa" and provider.current() is None

    with fabric_attention(wrapped, strict=True):
        assert _compat.attn_implementation_of(hf) == "cudnn" and cudnn_attention.is_strict() and provider.current() is not None
    assert _compat.attn_implementation_of(hf) == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), fabric_attention(wrapped):
        raise RuntimeError("inside")
    assert _compat.attn_implementation_of(hf) == "sdpa"
