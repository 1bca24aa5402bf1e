"""A stand-in for sgl_kernel, SGLang's compiled kernel package, for kvswap's SGLang tests and
benchmark on a GPU machine that has no sgl-kernel wheel (tests/bench/sglang_carry.sh carries it).

SGLang's modules import sgl_kernel's ops at module level on CUDA. Here every name and every
submodule resolves, to an op that raises when it is called: a path that reaches one of SGLang's
own copy kernels fails loudly, never does nothing. kvswap's hooks serve the copies instead.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+kvswap.standin"
STANDIN = True


class MissingOp:
    """An sgl_kernel name: any attribute of it is another one, and calling it raises."""

    def __init__(self, qualname: str) -> None:
        self.__qualname__ = self.__name__ = qualname

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingOp(f"{self.__qualname__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{self.__qualname__} is not available: this sgl_kernel is kvswap's stand-in "
                           f"(tests/bench/sglang_standins); a copy SGLang itself was asked to make reached it")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self.__qualname__}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingOp(f"{module_name}.{name}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.<anything>`` importable, as a stand-in module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: deeper names import too
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
