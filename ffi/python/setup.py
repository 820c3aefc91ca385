"""The wheel carries ``liblake.so``: a platform wheel (``py3-none-<platform>``,
ctypes, no CPython ABI), so ``pip install lake-kv`` needs no ``LAKE_LIBRARY``.

The library put in the wheel is ``$LAKE_WHEEL_LIBRARY`` if set (a library
already built), else this checkout's ``cargo build --release -p lake-ffi``.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent


def _library() -> Path:
    given = os.environ.get("LAKE_WHEEL_LIBRARY")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"LAKE_WHEEL_LIBRARY={given}: no such file")
        return path
    subprocess.run(["cargo", "build", "--release", "-p", "lake-ffi"], cwd=CHECKOUT, check=True)
    return CHECKOUT / "target" / "release" / "liblake.so"


class BuildWithLibrary(build_py):
    """Copies the engine library into the package it loads it from."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "lake" / "liblake.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_library(), target)


class PlatformWheel(bdist_wheel):
    """Tagged for the platform (it holds a native library), for any Python 3."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class WithNativeLibrary(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel}, distclass=WithNativeLibrary)
