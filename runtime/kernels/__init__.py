"""Attention kernels the torch targets' programs call through torch custom ops (runtime/backends/torch_ops.py).

`paged_attention.py`: the per-sequence PyTorch reference of paged attention over packed tokens (the
semantics every attention variant implements) and the Triton kernel that runs it on CUDA devices.
"""
