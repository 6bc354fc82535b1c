"""Dense bf16 peaks by device name, and MFU through Lightning's Throughput where its own table has no H200 entry."""

import pytest
import torch

from cudnn_attention.integrations.throughput import dense_bf16_peak_flops, lookup_dense_bf16_peak_flops

H200 = "NVIDIA H200"  # what torch.cuda.get_device_name() says on an H200 SXM


@pytest.mark.parametrize(
    "name, flops",
    [
        (H200, 989.4e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA GH200 480GB", 989.4e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_lookup_by_device_name(name, flops):
    assert lookup_dense_bf16_peak_flops(name) == flops


def test_device_argument_and_override(monkeypatch):
    assert dense_bf16_peak_flops("cpu") is None
    assert dense_bf16_peak_flops("cpu", override=1e12) == 1e12
    with pytest.raises(ValueError, match="positive"):
        dense_bf16_peak_flops(override=0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    assert dense_bf16_peak_flops(torch.device("cuda", 0)) == 989.4e12
    assert dense_bf16_peak_flops(0) == 989.4e12


def test_lightning_has_no_h200_peak_but_make_throughput_reports_mfu(monkeypatch):
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.throughput import get_available_flops

    from cudnn_attention.integrations.lightning import make_throughput

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) is None  # the gap this module fills
    throughput = make_throughput(device=torch.device("cuda", 0), window_size=2)
    assert throughput.available_flops == 989.4e12
    flops_per_batch, tokens_per_batch = 4e14, 8 * 1024  # one batch a second
    for step in (1, 2):  # time, batches, samples and lengths are running totals; flops are per update
        throughput.update(time=step * 1.0, batches=step, samples=8 * step, lengths=tokens_per_batch * step, flops=flops_per_batch)
    metrics = throughput.compute()
    assert metrics["device/items_per_sec"] == pytest.approx(tokens_per_batch)  # tokens/s
    assert metrics["device/mfu"] == pytest.approx(flops_per_batch / 989.4e12)


def test_throughput_monitor_logs_mfu_with_given_peak(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from cudnn_attention.integrations.lightning import CudnnThroughputMonitor

    class Linear(LightningModule):
        flops_per_batch = 1e9

        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)

    monitor = CudnnThroughputMonitor(
        batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(), available_flops=1e12, window_size=2
    )
    logger = CSVLogger(tmp_path)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Linear())
    assert monitor.available_flops == 1e12
    logger.experiment.save()
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "train/device/mfu" in header and "train/device/items_per_sec" in header
