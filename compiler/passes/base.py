"""The pass interface: a name, a typed config from the recipe, and `run(ctx)` that returns its stats.

A pass records what it did (stats go to the manifest) and the driver records how long it took
(build.json). A pass that does not apply to the target says why (`skip_reason`) and does nothing.
BuildContext and BuildError live in compiler/context.py (the quantization and attention code raise it too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from compiler.context import BuildContext, BuildError

if TYPE_CHECKING:  # pragma: no cover
    from compiler.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoOptions:
    """A pass without options."""


class Pass:
    """Base class: subclasses set `name`, `Config`, `requires` and implement `run`."""

    name: ClassVar[str]
    Config: ClassVar[type] = NoOptions
    requires: ClassVar[tuple[str, ...]] = ()  # passes that must run earlier in the list
    summary: ClassVar[str] = ""

    def __init__(self, config: Any) -> None:
        self.config = config

    def check_recipe(self, recipe: Recipe) -> tuple[str, str] | None:
        """(field under this pass, message) when the options do not fit the rest of the recipe; checked
        by plan() before any work, so the error names the recipe line."""
        return None

    def check_environment(self, recipe: Recipe) -> str | None:
        """None when this machine has what the pass needs (a GPU, a GPU package); else what is missing.
        Checked by build() before any pass runs (not by the dry run, which may run anywhere)."""
        return None

    def skip_reason(self, ctx: BuildContext) -> str | None:
        """None when the pass applies to this build's target; else the reason it does nothing."""
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


class QuantizePass(Pass):
    """Base of the quantize_* passes: they change capture's torch model before lower_onnx, one pass per
    `quant_kind` in a recipe; `run` opens with compiler/quant/state.py start_quantize."""

    requires: ClassVar[tuple[str, ...]] = ("capture",)
    quant_kind: ClassVar[str] = "weights"  # what it quantizes: "weights" or "kv_cache"


__all__ = ["BuildContext", "BuildError", "NoOptions", "Pass", "QuantizePass"]
