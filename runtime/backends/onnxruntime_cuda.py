"""ONNX Runtime CUDA backend: an onnxruntime/cuda artifact on the GPU, KV pools in device memory.

The artifact's graph (float16 or bfloat16) runs attention as com.microsoft.PagedAttention over the pools, which
writes this step's K/V into them in place (the op derives each token's slot from past_seqlens,
cumulative_sequence_length and the block table), so nothing is scattered on the host: the pools
are OrtValues on the device, bound with I/O binding on every run; the graph's new K/V outputs are
left on the device and unused. The step's small index arrays are copied to the device with the run;
the logits come back to the host.

CUDA graphs (the manifest's `cuda_graphs` plan): one session with ONNX Runtime's CUDA-graph option,
one graph per decode bucket (`gpu_graph_id` run option), each with its own fixed input/output
buffers updated in place before a replay; the other steps run in the same session with
gpu_graph_id -1 (no graph), so the weights are loaded once. A decode step of n sequences runs in the smallest bucket
b >= n: padding rows have no past, token 0 at position 0 and a block-table row that starts with the
extra pool block the scheduler never hands out (their K/V land there), logits dropped. When ONNX
Runtime refuses graphs for this model (it needs every node on the CUDA provider), the backend logs
why and runs eagerly (`graph_mode` says which). Needs onnxruntime-gpu and an NVIDIA GPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends import decode_bucket, read_geometry, stage_padded_decode
from runtime.forward_batch import ForwardBatch
from runtime.gpu import device_copy, missing_for

log = logging.getLogger(__name__)

_INDEX_INPUTS = ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table", "logits_index")
# pool element types for OrtValue allocation: a numpy type, or the ONNX element type for bfloat16 (numpy has
# none); the host zeros that initialise a pool are 16-bit patterns of 0 in either case
_POOL_TYPES: dict[str, Any] = {"float16": np.float16, "bfloat16": 16}  # 16 = TensorProto.BFLOAT16


class OnnxRuntimeCudaBackend:
    """ForwardBatch -> logits with ONNX Runtime's CUDA execution provider and in-place paged KV pools."""

    def __init__(self, model_path: Path, config: dict[str, Any], manifest: dict[str, Any],
                 num_blocks: int | None = None, graphs: str | None = None, device_id: int = 0) -> None:
        problem = missing_for("onnxruntime")
        if problem is not None:
            raise RuntimeError(problem)
        import onnxruntime as ort

        self._ort = ort
        kv_name = read_geometry(self, config, num_blocks)
        if kv_name not in _POOL_TYPES:
            raise RuntimeError(f"KV cache dtype {kv_name!r}: the ONNX Runtime CUDA backend runs float16 or bfloat16 "
                               "pools")
        kernel = manifest.get("kernels", {}).get("attention", {}).get("variant")
        if kernel != "paged_attention":
            raise RuntimeError(f"this artifact's attention is {kernel!r}; the ONNX Runtime CUDA backend needs the "
                               "paged_attention variant (in-place cache writes): rebuild with select_attention")
        self.device_id = device_id
        self.kv_dtype = np.float16 if kv_name == "float16" else None  # numpy has no bfloat16
        self._pool_type = _POOL_TYPES[kv_name]
        shape = (self.num_blocks + 1, self.block_size, self.kv_heads, self.head_dim)  # + the padding block
        self._k = [ort.OrtValue.ortvalue_from_shape_and_type(shape, self._pool_type, "cuda", device_id)
                   for _ in range(self.num_layers)]
        self._v = [ort.OrtValue.ortvalue_from_shape_and_type(shape, self._pool_type, "cuda", device_id)
                   for _ in range(self.num_layers)]
        zeros = np.zeros(shape, np.uint16)  # +0.0 in float16 and bfloat16 alike
        for t in self._k + self._v:
            t.update_inplace(zeros)
        self.pad_block = self.num_blocks
        self._model_path = model_path
        plan = manifest.get("cuda_graphs") or {}
        mode = graphs or ("off" if os.environ.get("OPTIMIZE_CUDA_GRAPHS", "1") == "0" else "auto")
        self.buckets: list[int] = list(plan.get("decode_buckets") or []) if plan.get("capturable") else []
        self.width = int(plan.get("block_table_width") or 0)
        self.graph_mode = "off"
        self.graph_replays = 0
        self._buckets: dict[int, dict[str, Any]] = {}
        self._eager_options: Any = None
        # One session: with CUDA graphs on, eager steps (prefill, mixed, large batches) run with
        # gpu_graph_id -1, which ONNX Runtime runs without capturing or replaying a graph.
        self.session = self._session(graphs=mode != "off" and bool(self.buckets))
        names = [i.name for i in self.session.get_inputs()]
        if names != config["graph"]["inputs"]:
            raise RuntimeError(f"{model_path.name}: graph inputs {names} differ from runtime.json")
        self.output_names = [o.name for o in self.session.get_outputs()]
        if mode != "off" and self.buckets:
            try:
                self._eager_options = ort.RunOptions()
                self._eager_options.add_run_config_entry("gpu_graph_id", "-1")
                self._prepare_buckets()
                self.graph_mode = "cuda"
            except Exception as e:  # ONNX Runtime refuses graphs when a node is not on the CUDA provider
                log.warning("ONNX Runtime CUDA graphs unavailable for this model, running eagerly: %s", e)
                self._buckets.clear()
                self._eager_options = None
                self.session = self._session(graphs=False)
        log.info("ONNX Runtime CUDA session, KV pool %s x %d layers, graphs %s (buckets %s)", shape,
                 self.num_layers, self.graph_mode, self.buckets)

    def _session(self, graphs: bool) -> Any:
        ort = self._ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts: dict[str, Any] = {"device_id": str(self.device_id)}
        if graphs:
            opts["enable_cuda_graph"] = "1"
        return ort.InferenceSession(str(self._model_path), so, providers=[("CUDAExecutionProvider", opts)])

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.num_layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * 2

    def _bind_pools(self, binding: Any) -> None:
        for i in range(self.num_layers):
            binding.bind_ortvalue_input(f"key_cache.{i}", self._k[i])
            binding.bind_ortvalue_input(f"value_cache.{i}", self._v[i])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer's pools (copy-on-write), device to device, pair after pair."""
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"copy_blocks: block pair ({src}, {dst}) outside the pool of {self.num_blocks}")
        block_bytes = self.block_size * self.kv_heads * self.head_dim * 2  # float16 / bfloat16
        for src, dst in pairs:
            for pool in self._k + self._v:
                base = pool.data_ptr()
                device_copy(base + dst * block_bytes, base + src * block_bytes, block_bytes, self.device_id)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run one step: returns logits [len(logits_index), vocab] float32; PagedAttention writes the K/V."""
        if batch.num_tokens and (int(batch.slot_mapping.min()) < 0
                                 or int(batch.slot_mapping.max()) >= self.num_blocks * self.block_size):
            raise ValueError("ForwardBatch.slot_mapping out of the KV pool's range")
        bucket = self._bucket_for(batch)
        if bucket is not None:
            return self._replay(batch, bucket)
        binding = self.session.io_binding()
        # PagedAttention writes through the block table: the whole table, not only the past blocks
        feeds = {"input_ids": batch.input_ids, "positions": batch.positions, "cu_seqlens": batch.cu_seqlens,
                 "past_lens": batch.past_lens, "block_table": np.ascontiguousarray(batch.block_table),
                 "logits_index": batch.logits_index}
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        self._bind_pools(binding)
        binding.bind_output("logits")  # on the host
        for name in self.output_names[1:]:
            binding.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding, self._eager_options)
        return binding.get_outputs()[0].numpy().astype(np.float32, copy=False)

    def _bucket_for(self, batch: ForwardBatch) -> int | None:
        return decode_bucket(batch, self.buckets, self.width) if self.graph_mode != "off" else None

    def _prepare_buckets(self) -> None:
        """Per bucket: fixed device buffers for every input and output, bound once; run once to capture."""
        ort = self._ort
        for gid, b in enumerate(self.buckets):
            host = {
                "input_ids": np.zeros(b, np.int64), "positions": np.zeros(b, np.int64),
                "cu_seqlens": np.arange(b + 1, dtype=np.int32), "past_lens": np.zeros(b, np.int32),
                "block_table": np.full((b, self.width), -1, np.int32), "logits_index": np.arange(b, dtype=np.int64),
            }
            host["block_table"][:, 0] = self.pad_block
            dev = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", self.device_id) for k, v in host.items()}
            binding = self.session.io_binding()
            for k in _INDEX_INPUTS:
                binding.bind_ortvalue_input(k, dev[k])
            self._bind_pools(binding)
            outs = {"logits": ort.OrtValue.ortvalue_from_shape_and_type((b, self.vocab_size), np.float32, "cuda",
                                                                         self.device_id)}
            for name in self.output_names[1:]:
                outs[name] = ort.OrtValue.ortvalue_from_shape_and_type((b, self.kv_heads, self.head_dim),
                                                                        self._pool_type, "cuda", self.device_id)
            for name, v in outs.items():
                binding.bind_ortvalue_output(name, v)
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("gpu_graph_id", str(gid + 1))
            self.session.run_with_iobinding(binding, run_options)  # captured on this or a later run
            self._buckets[b] = {"host": host, "dev": dev, "binding": binding, "logits": outs["logits"],
                                "run_options": run_options}

    def _replay(self, batch: ForwardBatch, b: int) -> np.ndarray:
        n = batch.num_seqs
        st = self._buckets[b]
        stage_padded_decode(st["host"], batch, self.pad_block, self.block_size)
        for k in ("input_ids", "positions", "past_lens", "block_table"):
            st["dev"][k].update_inplace(st["host"][k])
        self.session.run_with_iobinding(st["binding"], st["run_options"])
        self.graph_replays += 1
        return st["logits"].numpy()[:n]
