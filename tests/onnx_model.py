"""ONNX models the tests build by hand (one-node op models, small graphs): onnx.helper.make_model with the IR
version pinned to one that every supported ONNX Runtime loads (onnxruntime >= 1.20 reads IR 10, which opset 21
needs). Left to itself, make_model writes the installed onnx's newest IR (14 for onnx 1.23), which an older
ONNX Runtime refuses ("Unsupported model IR version"), although onnx and onnxruntime are each in range."""

from __future__ import annotations

from typing import Any

from onnx import ModelProto, helper

IR_VERSION = 10


def make_model(graph: Any, **kwargs: Any) -> ModelProto:
    return helper.make_model(graph, ir_version=IR_VERSION, **kwargs)
