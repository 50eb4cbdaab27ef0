"""The pass registry: recipe pass names -> pass classes (one pass per file in this folder)."""

from __future__ import annotations

from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.passes.capture import CapturePass
from compiler.passes.lower_onnx import LowerOnnxPass
from compiler.passes.package import PackagePass

PASSES: dict[str, type[Pass]] = {
    p.name: p
    for p in (
        # capture
        CapturePass,
        # lowering
        LowerOnnxPass,
        # packaging
        PackagePass,
    )
}


def pass_options() -> dict[str, type]:
    """name -> options dataclass, for the recipe loader's option checks."""
    return {name: cls.Config for name, cls in PASSES.items()}


__all__ = ["PASSES", "BuildContext", "BuildError", "Pass", "pass_options"]
