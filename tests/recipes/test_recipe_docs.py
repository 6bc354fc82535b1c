"""The README's recipe section against what is installed: the extra each recipe needs, the package a README example
needs, and the size of what a Linux install pulls in for the GPU path, measured from the installed distributions."""

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

from cudnn_attention.recipes.common.errors import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RECIPES = README[README.index("## Recipes") :]


def test_every_extra_a_recipe_error_names_exists():
    extras = set(importlib.metadata.metadata("cudnn-attention").get_all("Provides-Extra") or [])
    assert set(EXTRAS.values()) <= extras, (set(EXTRAS.values()) - extras, extras)


def test_the_readme_says_the_lightning_recipe_needs_its_extra():
    # Item 2: the main job installs .[hf,recipes]; the Lightning recipe also imports lightning.
    (row,) = [line for line in RECIPES.splitlines() if line.startswith("| `recipes/train_lightning.py`")]
    assert 'pip install -e ".[hf,recipes,lightning]"' in row, row


def test_each_report_to_example_installs_its_package_first():
    # Item 6: the README's --report_to tensorboard ended in a transformers traceback where tensorboard was not installed.
    blocks = re.findall(r"```bash\n(.*?)```", RECIPES, re.DOTALL)
    examples = [(block, name) for block in blocks for name in re.findall(r"--report_to (\w+)", block)]
    assert examples
    for block, name in examples:
        assert block.index(f"pip install {name}") < block.index(f"--report_to {name}"), block


def _dependency_closure(name: str) -> set[str]:
    """``name`` and what it requires on this machine, transitively, with the extras it asks of its requirements (the test
    is skipped where one of them is not installed)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, visited, todo = set(), set(), [(name, "")]
    while todo:
        current, extra = todo.pop()
        if (canonicalize_name(current), extra) in visited:
            continue
        visited.add((canonicalize_name(current), extra))
        try:
            requires = importlib.metadata.requires(current) or []
        except importlib.metadata.PackageNotFoundError:
            # Installed without its dependencies (pip --no-deps, as the GPU machine's offline wheels are): nothing to measure.
            pytest.skip(f"{current}, which {name} requires, is not installed here")
        seen.add(canonicalize_name(current))
        for requirement in map(Requirement, requires):
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                # nvidia-cudnn-frontend asks for nvidia-cutlass-dsl[cu13]: that extra's requirements come with it.
                todo += [(requirement.name, wanted) for wanted in ("", *requirement.extras)]
    return seen


def _installed_mib(name: str) -> float:
    distribution = importlib.metadata.distribution(name)
    paths = (distribution.locate_file(f) for f in distribution.files or [])
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) / 2**20


def test_the_readme_size_of_the_gpu_path_dependencies_is_what_they_take_here():
    # Item 9: a CPU install downloads the frontend's CUDA-only dependencies; the README says what and how much.
    try:
        importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the cuDNN frontend is not installed here (no wheel for this platform)")
    closure = _dependency_closure("nvidia-cudnn-frontend")
    sizes = {name: _installed_mib(name) for name in closure}
    stated = int(re.search(r"about (\d+) MiB installed", RECIPES).group(1))
    assert 0.8 * stated <= sum(sizes.values()) <= 1.2 * stated, sizes
    for name, mib in sizes.items():
        if mib >= 5 and name != "nvidia-cudnn-frontend":  # the large ones are named (the cutlass libraries by suffix)
            suffix = name.removeprefix("nvidia-cutlass-dsl-libs")
            assert f"`{name}`" in RECIPES or f"`{suffix}`" in RECIPES, (name, mib)
