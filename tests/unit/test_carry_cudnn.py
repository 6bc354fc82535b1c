"""``benchmarks/carry_cudnn.sh`` on the device side: parts arrive one call at a time and only the last one unpacks; parts
that do not add up are refused; ``env`` names the unpacked folder. (``prepare`` needs the package index; it was run by
hand, see docs/decisions/0015.)"""

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "carry_cudnn.sh"
LIBRARIES = {"libcudnn.so.9": b"shim" * 1000, "libcudnn_graph.so.9": bytes(range(256)) * 400}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _parts(folder: Path, *, count: int, corrupt: bool = False) -> list[Path]:
    """What ``prepare`` writes: a tar of xz-compressed libraries, split into ``count`` folders, each with the manifest."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in LIBRARIES.items():
            packed = lzma.compress(data)
            info = tarfile.TarInfo(f"./{name}.xz")
            info.size = len(packed)
            tar.addfile(info, io.BytesIO(packed))
    whole = buffer.getvalue()
    manifest = f"version=9.28.1.4\nparts={count}\nsha256={hashlib.sha256(whole).hexdigest()}\nlibs={' '.join(LIBRARIES)}\n"
    size = -(-len(whole) // count)
    folders = []
    for i in range(count):
        part = folder / f"part{i + 1:02d}"
        part.mkdir(parents=True)
        chunk = whole[i * size : (i + 1) * size]
        if corrupt and i == count - 1:
            chunk = chunk[:-1] + bytes([chunk[-1] ^ 1])
        (part / f"libs.tar.part{i + 1:02d}").write_bytes(chunk)
        (part / "manifest").write_text(manifest)
        shutil.copy(SCRIPT, part / "carry_cudnn.sh")
        folders.append(part)
    return folders


def _run(script: Path, command: str, store: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDNN_CARRY_STORE": str(store), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(script), command], capture_output=True, text=True, env=env, timeout=60)


def test_the_last_part_unpacks_every_library(tmp_path):
    store = tmp_path / "store"
    first, second, third = _parts(tmp_path / "carried", count=3)
    for part, said in ((first, "1 of 3 parts"), (second, "2 of 3 parts")):
        result = _run(part / "carry_cudnn.sh", "receive", store)
        assert result.returncode == 0 and said in result.stderr, result.stderr
        assert not (store / "site").exists()
    result = _run(third / "carry_cudnn.sh", "receive", store)
    assert result.returncode == 0 and "unpacked" in result.stderr, result.stderr
    lib = store / "site" / "nvidia" / "cudnn" / "lib"
    assert {p.name: p.read_bytes() for p in lib.iterdir()} == LIBRARIES
    env = _run(SCRIPT, "env", store)
    assert env.returncode == 0 and f"export LD_LIBRARY_PATH={lib}" in env.stdout and "CUDNN_CARRIED=9.28.1.4" in env.stdout
    # torch's own preload (the first nvidia/cudnn/lib along sys.path) must find the carried file, not torch's
    assert f"export PYTHONPATH={store / 'site'}" in env.stdout, env.stdout


def test_parts_that_do_not_add_up_are_refused(tmp_path):
    store = tmp_path / "store"
    parts = _parts(tmp_path / "carried", count=2, corrupt=True)
    results = [_run(part / "carry_cudnn.sh", "receive", store) for part in parts]
    assert results[-1].returncode != 0 and "do not add up" in results[-1].stderr, results[-1].stderr
    assert not (store / "site").exists()
    assert _run(SCRIPT, "env", store).returncode != 0  # nothing to point the loader at
