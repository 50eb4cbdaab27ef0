"""Attention kernels the torch targets' programs call through torch custom ops (runtime/backends/torch_ops.py).

`paged_attention.py`: the per-sequence PyTorch reference of paged attention over packed tokens (the
semantics every attention variant implements) and the Triton kernel that runs it on CUDA devices.
`flashinfer_attention.py`: the same attention through FlashInfer's paged and ragged kernels (planned on
the host once per step by the torch backend). `int4_matmul.py`: the INT4 weight-only matmul.
"""

# head dimensions FlashInfer's attention kernels are compiled for (read by the variant's candidate check)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
