"""Builds the C codec (compcomm/csrc/codec.c) with the package; the rest is in pyproject.toml.

Without the C codec compcomm still works, through torch code that gives the same bits about
10x slower per call on CPU. So a build that cannot compile it stops with a message saying so, unless
COMPCOMM_ALLOW_NO_NATIVE=1 asks for the slow install (which then warns at every first use).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPT_OUT = "COMPCOMM_ALLOW_NO_NATIVE"


class BuildCodec(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - whatever the compiler toolchain raises
            message = (
                f"compcomm: the C codec could not be compiled ({type(exc).__name__}: {exc}). "
                "Without it compcomm runs its torch kernels, the same bits about 10x slower per call on CPU. "
                "Install a C compiler (gcc or clang) and retry, or set "
                f"{OPT_OUT}=1 to install without it."
            )
            if os.environ.get(OPT_OUT) != "1":
                raise RuntimeError(message) from exc
            ext.optional = True  # nothing to copy or package
            banner = "!" * 78
            print(f"\n{banner}\n{message}\n{banner}\n", file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "compcomm._codec_native",
            sources=["compcomm/csrc/codec.c"],
            depends=["compcomm/csrc/codec_abi.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ],
    cmdclass={"build_ext": BuildCodec},
)
