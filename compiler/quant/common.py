"""Quantization helpers that need neither torch nor onnx: name patterns, group-size rules, stored sizes.

The pass registry imports the quantize passes to read their options; keeping these helpers light
means a dry run (`optimize build --dry-run`) and the recipe checks never import torch.
"""

from __future__ import annotations

import fnmatch
from typing import Any


def matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """fnmatch on the module name; a pattern without wildcards also matches as the last name part."""
    for p in patterns:
        if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}"):
            return True
    return False


def check_group_size(group_size: int) -> None:
    """MatMulNBits and blocked DequantizeLinear want a power of two >= 16."""
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")


def module_of(hf_name: str, shape: tuple[int, ...]) -> tuple[str, str | None]:
    """(our module name, "linear" | "embedding" | None) of a checkpoint tensor, for dry-run estimates."""
    module = hf_name.removeprefix("model.").removesuffix(".weight")
    if len(shape) != 2 or not hf_name.endswith(".weight"):
        return module, None
    return module, "embedding" if module.endswith("embed_tokens") else "linear"


def int4_bytes(shape: tuple[int, ...], group_size: int) -> int:
    """Stored bytes of an INT4 [out, in] weight as MatMulNBits holds it (padded blocks, scales, zeros)."""
    out, cols = shape
    g = -(-cols // group_size)
    return out * g * (group_size // 2) + out * g * 4 + out * -(-g // 2)


class Int4WeightSizes:
    """Dry-run size estimate of the INT4 weight-only passes (their config has group_size and ignore)."""

    config: Any

    def estimated_bytes(self, module: str, shape: tuple[int, ...], kind: str | None) -> int | None:
        """Stored bytes of a checkpoint tensor after this pass (None: left as it is), for the dry run."""
        if kind != "linear" or matches(module, self.config.ignore):
            return None
        return int4_bytes(shape, self.config.group_size)


# GPTQ's true-sequential steps: the Linears of a decoder layer in the order their inputs become final
SEQUENTIAL_ROLES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)


def sequential_steps(names: list[str]) -> list[list[str]]:
    """`names` (one layer's target Linears) in SEQUENTIAL_ROLES' steps; any other Linear in a last step."""
    steps = [[n for n in names if n.rsplit(".", 1)[-1] in roles] for roles in SEQUENTIAL_ROLES]
    rest = [n for n in names if not any(n in s for s in steps)]
    return [s for s in steps if s] + ([rest] if rest else [])
