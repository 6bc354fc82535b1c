"""A stand-in for the cuDNN frontend module (``import cudnn``) whose library reports a given version, or fails to load."""

import sys
import types


def install_fake_frontend(monkeypatch, backend, *, version: str = "1.32.0") -> None:
    """Make ``import cudnn`` give a module of frontend ``version`` whose ``backend_version()`` returns ``backend`` (an
    int, as 92801 for 9.28.1) or raises it (an exception, as frontend 1.32 does beside a CPU build of torch)."""

    def backend_version():
        if isinstance(backend, BaseException):
            raise backend
        return backend

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(__version__=version, backend_version=backend_version))
