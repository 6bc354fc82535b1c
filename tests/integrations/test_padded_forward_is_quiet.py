"""A padded batch through attn_implementation="cudnn" prints nothing of torch's: no warning about is_fx_tracing
(torch 2.13 logs one the first time anything asks it, once per process, hence a fresh interpreter here)."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

PROGRAM = textwrap.dedent("""
    import torch, transformers
    import cudnn_attention

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("cudnn")
    ids = torch.randint(3, 64, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])  # left padding: the mask function keeps it
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    print("forward", tuple(logits.shape), bool(torch.isfinite(logits).all()))
""")


def test_a_padded_forward_through_the_mask_function_logs_no_torch_warning():
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "forward (2, 7, 64) True"
    assert "is_fx_tracing" not in result.stderr, result.stderr[-3000:]
