"""Build the runtime's C extension (plain C, CPython API + buffer protocol; no numpy headers)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "runtime.core._core",
            sources=["runtime/core/_core.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
        )
    ]
)
