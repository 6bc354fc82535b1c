"""attn_implementation="cudnn" in a program that never imports cudnn_attention: the start-up hook the package installs
(``cudnn_attention_autoload.pth``), and ``CUDNN_ATTENTION_NO_AUTOLOAD=1``, which turns it off."""

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

# Never imports cudnn_attention: names "cudnn" as a string only, as trl sft or a YAML-configured trainer does.
PROGRAM = textwrap.dedent("""
    import json, sys, torch, transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    try:
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="cudnn")
    except ValueError as error:
        print(json.dumps({"refused": str(error)}))
        raise SystemExit(0)
    logits = model(torch.randint(0, 64, (2, 6))).logits
    from cudnn_attention import stats  # after the fact: what served the forward
    print(json.dumps({"implementation": model.config._attn_implementation, "served": stats()["fallback_forward"],
                      "shape": list(logits.shape)}))
""")


def _installed_pth() -> Path:
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        if (Path(directory) / "cudnn_attention_autoload.pth").exists():
            return Path(directory) / "cudnn_attention_autoload.pth"
    pytest.fail("cudnn_attention_autoload.pth is not in site-packages: reinstall the package (pip install -e .)")


def _run(code: str, **env) -> dict:
    environ = {key: value for key, value in os.environ.items() if key != "CUDNN_ATTENTION_NO_AUTOLOAD"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, env={**environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_installed_hook_serves_a_program_that_never_imports_cudnn_attention():
    _installed_pth()
    assert _run(PROGRAM) == {"implementation": "cudnn", "served": {"cpu tensors": 2}, "shape": [2, 6, 64]}  # one call per layer


def test_the_off_switch_leaves_transformers_to_refuse_the_name():
    _installed_pth()
    refused = _run(PROGRAM, CUDNN_ATTENTION_NO_AUTOLOAD="1")["refused"]
    assert 'attn_implementation="cudnn"` is not supported' in refused


def test_start_up_imports_nothing_but_the_hook():
    _installed_pth()
    code = (
        "import json, sys; print(json.dumps([sorted(m for m in ('torch', 'transformers', 'cudnn_attention') if m in sys.modules), "
        "[type(f).__name__ for f in sys.meta_path if type(f).__name__ == 'ImportCudnnAttentionAfterLoad']]))"
    )
    assert _run(code) == [[], ["ImportCudnnAttentionAfterLoad"]]
    assert _run(code, CUDNN_ATTENTION_NO_AUTOLOAD="1") == [[], []]
