"""The one build step pyproject.toml cannot declare: ``cudnn_attention_autoload.pth`` at the top of site-packages.

Python's ``site`` runs the import line of each ``.pth`` file there at start-up; this one installs the hook that makes
``attn_implementation="cudnn"`` work in programs that never import cudnn_attention
(integrations/hf/bootstrap/cudnn_attention_autoload/__init__.py; ``CUDNN_ATTENTION_NO_AUTOLOAD=1`` turns it off). setuptools
has no setting for a file at the root of a wheel, so build_py copies it there, and editable_wheel, whose wheel holds
no build output but its import hook, adds it to that wheel. Everything else is in pyproject.toml.
"""

import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path("integrations/hf/bootstrap/cudnn_attention_autoload.pth")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib, PTH.name)), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH.name))]


class EditableWheelWithPth(editable_wheel):
    def run(self):
        super().run()
        # The wheel module setuptools writes its own wheels with (vendored by setuptools >= 70.1): it records every
        # file, the one added here included, in RECORD, so that pip uninstall removes it too.
        from wheel.wheelfile import WheelFile

        for path in Path(self.dist_dir).glob("*.whl"):
            with zipfile.ZipFile(path) as built:
                entries = [(info, built.read(info)) for info in built.infolist() if not info.filename.endswith(".dist-info/RECORD")]
            with WheelFile(path, "w") as wheel:
                for info, data in entries:
                    wheel.writestr(info, data)
                wheel.write(str(PTH), PTH.name)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
