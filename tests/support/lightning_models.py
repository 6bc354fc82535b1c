"""A tiny LightningModule around a random Hugging Face Llama, shared by the CPU and GPU Lightning tests (no downloads)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset


def tiny_llama(*, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 64, attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class TinyLlamaModule(LightningModule):
    """Records ``config._attn_implementation`` (and whether the provider is installed) at every training step."""

    def __init__(
        self, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 64, seq_len: int = 16, batch_size: int = 2
    ):
        super().__init__()
        self.hf = tiny_llama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab)
        self.initial_implementation = self.hf.config._attn_implementation
        self.seq_len, self.batch_size, self.vocab = seq_len, batch_size, vocab
        self.seen_implementations: list[str] = []
        self.seen_provider: list[bool] = []

    def training_step(self, batch, batch_idx):
        import cudnn_attention

        self.seen_implementations.append(self.hf.config._attn_implementation)
        self.seen_provider.append(cudnn_attention.provider.current() is not None)
        (ids,) = batch
        return self.hf(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab, (8 * self.batch_size, self.seq_len), generator=generator)
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)
