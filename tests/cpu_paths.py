"""The CPU code paths of the package's C ops (runtime/kernels/isa_*.c) as the tests see them: which paths
this host can run, read from the kernel's own flags in /proc/cpuinfo (independently of the library's
cpuid checks, so a wrong detection shows), and a parameter that runs a test on one path or skips it
naming the CPU features the host lacks. A comparison of two paths is only made where both run here."""

from __future__ import annotations

import platform
from functools import cache

import pytest

PATHS = ("avx512", "avx2", "baseline")
# /proc/cpuinfo flag names of the features each path needs (the library asks __builtin_cpu_supports)
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"), "avx2": ("avx2", "fma"),
         "baseline": ()}


@cache
def host_flags() -> frozenset[str]:
    """The CPU flags the kernel reports (empty off Linux/x86-64: only the baseline path is built there)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing(path: str) -> list[str]:
    """The features path needs that this host lacks ([] when it can run it)."""
    if path != "baseline" and platform.machine() not in ("x86_64", "AMD64"):
        return [f"x86-64 ({platform.machine()})"]
    return [f for f in NEEDS[path] if f not in host_flags()]


def expected_default() -> str:
    """The path the library must choose by itself: the widest this host runs."""
    return next(p for p in PATHS if not missing(p))


def bf16_dot() -> bool:
    """Whether MatMulBf16's avx512 path multiplies with vdpbf16ps here (AVX-512 BF16)."""
    return expected_default() == "avx512" and "avx512_bf16" in host_flags()


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the ops' code path for the sessions the test creates (OPTIMIZE_CPU_ISA, read at registration), or
    skip the test naming what this CPU lacks."""
    lacks = missing(path)
    if lacks:
        pytest.skip(f"the {path} path: this CPU lacks {' '.join(lacks)}")
    monkeypatch.setenv("OPTIMIZE_CPU_ISA", path)


@pytest.fixture(params=PATHS)
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each code path in turn, pinned for the test's sessions; skipped (naming the missing features) where
    this host cannot run it."""
    use_path(request.param, monkeypatch)
    return request.param
