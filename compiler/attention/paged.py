"""The PagedAttention (ONNX Runtime CUDA) form of a model, built and validated on CPU.

There is no CUDA kernel on this machine, so the variant is never run here: `paged_attention_model()`
captures and lowers a checkpoint with every layer's attention as one com.microsoft.PagedAttention
node (float16 by default: the op takes float16/bfloat16 only, so the pools are float16 too), and
`validate_paged_attention()` checks every such node against ONNX Runtime's registered schema
(compiler/attention/schema.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiler.attention.schema import validate_model
from compiler.checkpoint import inspect_checkpoint, load_weights
from compiler.export import export_forward_batch, lower_exported


def paged_attention_model(checkpoint: str | Path, block_size: int = 16, dtype: str = "float16",
                          opset: int = 21) -> Any:
    """ModelProto of the checkpoint (its weights) with PagedAttention attention, in `dtype`."""
    import torch

    from compiler.models.llama import LlamaForwardBatchModel

    info = inspect_checkpoint(Path(checkpoint))
    cfg = info.config
    tdtype = getattr(torch, dtype)
    model = LlamaForwardBatchModel(cfg, block_size, attention="paged_attention")
    model.load_hf_state_dict(load_weights(info), tdtype)
    model.eval()
    exported, _ = export_forward_batch(model, cfg, block_size, tdtype)
    return lower_exported(exported, cfg.num_layers, opset, True, "paged_attention")


def validate_paged_attention(model: Any) -> dict[str, Any]:
    """Every PagedAttention node against ONNX Runtime's schema; {"nodes", "typed_inputs", "problems"}."""
    return validate_model(model, "PagedAttention")
