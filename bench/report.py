"""What the benches share at their end: the result written as JSON where --json says, and said so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
