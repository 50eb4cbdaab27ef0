"""scripts/memcheck.sh in the default suite: the C engine core built with AddressSanitizer and
UndefinedBehaviorSanitizer runs its tests (the script's TESTS list) without a report.

The tests run as in the plain suite (all 200 random streams: their coverage floors do not scale
down, hypothesis draws its simplest streams first); measured 1.5-2.5 minutes on 2 busy cores before the
C kernels' tests ran once per CPU code path (avx2 and baseline on an AVX2 machine, three paths with
AVX-512); 19 minutes on 2 cores shared with a load average above 20.
Needs gcc and its libasan (Debian's gcc depends on it); the script fails, never skips, when it is
missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_memcheck_script_passes() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "memcheck.sh")], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "memcheck: OK" in out and "-fsanitize=address,undefined" in out, out[-3000:]
    passed = re.search(r"^(\d+) passed", res.stdout, re.MULTILINE)
    assert passed and int(passed.group(1)) >= 150, out[-3000:]  # every listed file ran (155 tests)
