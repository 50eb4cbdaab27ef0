"""bench/soak.py in its short setting: one server, good and hostile clients, the soak's checks all pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_short_setting(demo_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # bounds looser than the long setting's: this suite shares two cores with other jobs
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), str(demo_artifact), "--duration", "10", "--quiet", "4",
           "--good-clients", "2", "--flood", "40", "--health-bound", "1.0", "--p99-factor", "6", "--p99-slack", "1.0",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    summary = json.loads(out.read_text())
    assert r.returncode == 0, r.stderr + json.dumps(summary["checks"], indent=1)
    assert summary["passed"] and all(summary["checks"].values())
    assert summary["good"]["attack"] >= 5 and not summary["good"]["failures"]
    assert summary["hostile"]["actions"] >= 20 and not summary["hostile"]["unexpected"]
    dropped = summary["server_after"]
    assert dropped['optimize_connections_dropped_total{reason="header_timeout"}'] >= 1
    assert dropped["kv_blocks_used"] == 0 and dropped["open_connections"] <= 1
