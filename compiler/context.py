"""What one build's passes share: the BuildContext they hand each other, and BuildError, which any build step
raises (passes, the quantization and attention code under them, the driver).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from compiler.checkpoint import CheckpointInfo
    from compiler.recipe import Recipe


@dataclass
class BuildContext:
    """Everything passes hand to each other during one build."""

    recipe: Recipe
    checkpoint: CheckpointInfo
    staging: Path  # the artifact folder being written (renamed into place when the build succeeds)
    artifacts: dict[str, Any] = field(default_factory=dict)  # in-memory products: "model", "exported", "onnx", ...
    manifest: dict[str, Any] = field(default_factory=dict)  # deterministic facts for manifest.json
    build_info: dict[str, Any] = field(default_factory=dict)  # run-to-run facts for build.json
    completed: list[str] = field(default_factory=list)  # names of passes that have run

    @property
    def max_model_len(self) -> int:
        """The context the artifact serves: the recipe's runtime.max_model_len, at most the model's positions
        (what runtime.json records and every pass sizes for)."""
        return min(self.recipe.runtime.max_model_len, self.checkpoint.config.max_position_embeddings)

    def require(self, key: str, by: str) -> Any:
        if key not in self.artifacts:
            raise BuildError(f"pass {by!r} needs {key!r}, which no earlier pass produced")
        return self.artifacts[key]


class BuildError(Exception):
    """A build step failed; the message says which and why."""


__all__ = ["BuildContext", "BuildError"]
