"""Write tests/data/torch_varlen_schemas.json from torch wheels: the schema each release registers for its varlen ops.

Maintainer's tool, not run by the tests. The ``torch_attn`` varlen ops are ``torch.library.custom_op``
functions in ``torch/nn/attention/varlen.py``, whose schema torch infers from the Python signature.
This reads that file out of each wheel (any platform: it is pure Python; macOS wheels are the
smallest), infers the schema of each op with the installed torch's public ``torch.library.infer_schema``
and records it with the release's commit (``torch/version.py``'s ``git_version``). The installed
torch's own schemas are compared against their entry by tests/unit/test_provider_varlen_schemas.py,
which checks the inference.

Usage (a new release: add its wheel and run again)::

    pip download torch==2.15.0 --no-deps --only-binary=:all: --platform macosx_14_0_arm64 --python-version 3.12 -d wheels/
    python tests/data/varlen_schemas_from_wheels.py wheels/torch-*.whl > tests/data/torch_varlen_schemas.json
"""

import ast
import contextlib
import json
import re
import sys
import zipfile

import torch

VARLEN = "torch/nn/attention/varlen.py"
SOURCE_URL = "https://github.com/pytorch/pytorch/blob/{commit}/" + VARLEN
NO_VARLEN_URL = "https://github.com/pytorch/pytorch/tree/{commit}/torch/nn/attention"  # a release without varlen.py


def custom_op_schemas(source: str) -> dict[str, str]:
    """``{op name: schema}`` for each ``@torch.library.custom_op("torch_attn::...")`` function in ``source``."""
    tree = ast.parse(source)
    # Module-level constants a default may name (2.15: backend=_FLASH_ATTENTION_BACKEND, from SDPBackend).
    namespace = {"torch": torch, "SDPBackend": torch.nn.attention.SDPBackend, "Any": object}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(target, ast.Name) for target in node.targets):
            # Executing the release's own constant definitions is the point; one that needs names
            # not provided here is no default's value.
            with contextlib.suppress(Exception):
                exec(compile(ast.Module([node], []), VARLEN, "exec"), namespace)  # noqa: S102
    schemas = {}
    for node in tree.body:
        for decorator in getattr(node, "decorator_list", []):
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "torch.library.custom_op":
                qualified = decorator.args[0].value
                mutates = ast.literal_eval(next(k.value for k in decorator.keywords if k.arg == "mutates_args"))
                stub = ast.FunctionDef(
                    name=node.name,
                    args=node.args,
                    body=[ast.Expr(ast.Constant(...))],
                    decorator_list=[],
                    returns=node.returns,
                    type_params=[],
                )
                exec(compile(ast.fix_missing_locations(ast.Module([stub], [])), VARLEN, "exec"), namespace)  # noqa: S102
                schemas[qualified.split("::")[1]] = qualified + torch.library.infer_schema(namespace[node.name], mutates_args=mutates)
    return schemas


def main(wheels: list[str]) -> None:
    releases = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            version_py = archive.read("torch/version.py").decode()
            version = re.search(r"__version__ = '([^'+]+)", version_py)[1]
            commit = re.search(r"git_version = '([0-9a-f]+)'", version_py)[1]
            source = archive.read(VARLEN).decode() if VARLEN in archive.namelist() else None
        minor = ".".join(version.split(".")[:2])
        schemas = custom_op_schemas(source) if source else {}
        url = (SOURCE_URL if source else NO_VARLEN_URL).format(commit=commit)
        entry = releases.setdefault(minor, {"commits": {}, "source": url, "schemas": schemas})
        if entry["schemas"] != schemas:
            sys.exit(f"torch {version} registers other varlen schemas than the rest of {minor}: give it an entry of its own")
        entry["commits"][version] = commit
    document = {
        "about": "Schemas of torch_attn::_varlen_attn{,_out,_backward} per torch release (none: no varlen API), "
        "inferred from each release's torch/nn/attention/varlen.py by tests/data/varlen_schemas_from_wheels.py.",
        "releases": dict(sorted(releases.items(), key=lambda item: tuple(int(part) for part in item[0].split(".")))),
    }
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
