"""optimize runtime: load a built artifact and serve it (paged KV cache, continuous batching).

Thin by design: this package never imports `compiler` or `torch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]

if TYPE_CHECKING:  # pragma: no cover
    from runtime.engine import LLM
    from runtime.sampling import SamplingParams
    from runtime.structured import StructuredOutput


def __getattr__(name: str) -> Any:
    # Lazy so that `import runtime.artifact` (verify, inspect) stays light.
    if name == "LLM":
        from runtime.engine import LLM

        return LLM
    if name == "SamplingParams":
        from runtime.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutput":
        from runtime.structured import StructuredOutput

        return StructuredOutput
    raise AttributeError(name)
