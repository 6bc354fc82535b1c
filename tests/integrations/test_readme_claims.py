"""What the README says a user can import or will meet, against the installed package and transformers."""

import importlib
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _paragraph(containing: str) -> str:
    """The README paragraph (or list item) that holds ``containing``, on one line."""
    (found,) = [block for block in re.split(r"\n(?=\s*\n|- )", README) if containing in block]
    return " ".join(found.split())


def test_every_import_the_readme_writes_works():
    imports = re.findall(r"from (cudnn_attention[\w.]*) import ([\w, ]+)", README)
    assert imports
    for module, names in imports:
        imported = importlib.import_module(module)
        for name in names.replace(",", " ").split():
            assert hasattr(imported, name), f"README: from {module} import {name}"


def test_the_throughput_helpers_are_named_with_the_module_they_import_from():
    # The README placed them in cudnn_attention.integrations.throughput, where importing them raised ImportError.
    pytest.importorskip("lightning")
    (item,) = [line for line in README.splitlines() if "CudnnThroughputMonitor" in line and "make_throughput" in line]
    assert "from cudnn_attention.integrations.lightning import CudnnThroughputMonitor, make_throughput" in item, item


def test_a_mistyped_implementation_name_is_explained_in_the_readme():
    # transformers' own error lists its built-in names and leaves out registered ones, "cudnn" among them; the error is
    # raised in transformers' code, with none of this package's between it and the user, so the README says what it means.
    pytest.importorskip("transformers")
    from support.hf_models import build

    with pytest.raises(ValueError, match='attn_implementation="cudnn2"` is not supported') as raised:
        build("llama", "cudnn2")
    assert '"cudnn"' not in str(raised.value) and "=cudnn`" not in str(raised.value)  # when it is listed, the line can go
    line = _paragraph('`attn_implementation="cudnn2"`')
    assert 'attn_implementation="cudnn"' in line and "leaves out" in line, line
