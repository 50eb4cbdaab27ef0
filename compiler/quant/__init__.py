"""Quantization math shared by the quantize_* passes and the lower_quant pass.

- `int4`        asymmetric INT4 with groups along the input dimension (zero points, padded last group)
- `fp8`         FP8 E4M3 scales and casts (weights per channel / per tensor, activations)
- `calibration` the recipe's calibration text -> token windows, and a layer-by-layer runner of our
                model definition that captures what each Linear sees
- `awq`, `gptq` the two INT4 methods (activation-aware scaling + clipping; Hessian-based rounding)
- `state`       what the passes record (quantized tensors, scales) for lowering and the manifest
- `onnx_rules`  ONNX rewrites: quantized weight -> DequantizeLinear (QDQ), DQ + Gemm -> MatMulNBits,
                activation and KV-cache Q/DQ

Everything here is torch (build side) except `onnx_rules` (onnx protobuf + numpy).
"""
