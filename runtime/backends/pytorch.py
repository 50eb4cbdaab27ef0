"""PyTorch backend: runs an artifact's captured program (model.pt2, torch.export) on one ForwardBatch.

Same contract as the ONNX Runtime backend: the program takes the ForwardBatch arrays plus the
per-layer KV pools [num_blocks, block_size, kv_heads, head_dim] and returns logits plus each
layer's new K/V, which this backend writes into its pools at `slot_mapping` (`index_copy_` on the
pool viewed as slots). torch is imported only when such an artifact is loaded.

Attention. A program built with the `triton` variant calls optimize::paged_attention_triton
(runtime/backends/torch_ops.py): the Triton kernel on CUDA (triton must be installed: checked at
load), the per-sequence PyTorch reference on CPU. A program built with the `flashinfer` variant calls
optimize::paged_attention_flashinfer: on CUDA this backend plans FlashInfer's wrappers on the host once
per step, before the program runs or a decode graph replays (runtime/kernels/flashinfer_attention.py;
one CUDA-graph decode wrapper per bucket); on CPU the op runs the reference.

Devices. The program is exported device-neutral; on `cuda` it is moved to the GPU at load
(`torch.export.passes.move_to_device_pass`) with the pools in device memory. On CPU the numpy
arrays become tensors without copies and the pools have numpy views (`k_pools`, `v_pools`).

Decode buckets (the manifest's `cuda_graphs` plan, compiler/passes/plan_cuda_graphs.py). A decode
step of n sequences (one token each, logits for each) runs in the smallest bucket b >= n on static
buffers: rows n..b-1 are padding (token 0 at position 0, no past, logits dropped) whose block-table row
and slot name one extra pool block the scheduler never hands out, where their K/V go; the block table
is padded with -1 to the plan's fixed width (runtime/backends stage_padded_decode). On CUDA each bucket's step (program + K/V writes) is
captured once at load as a CUDA graph and replayed (`graphs="auto"`). `graphs="padded"` runs the
same padded static-shape step without capture (what the CPU tests check against transformers);
`graphs="off"` (or OPTIMIZE_CUDA_GRAPHS=0) runs every step eagerly. Prefill, mixed steps and
decode batches larger than the largest bucket always run eagerly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends import decode_bucket, read_geometry, stage_padded_decode
from runtime.forward_batch import ForwardBatch
from runtime.gpu import missing_for
from runtime.pt2_check import check_pt2

log = logging.getLogger(__name__)

_KV_DTYPES = ("float32", "float16", "bfloat16")
GRAPH_MODES = ("auto", "padded", "off")


def callable_program(exported: Any) -> Any:
    """The exported program as a module, without its input guards: export traces with sizes >= 2 and
    guards the dynamic dims to that range (size 0/1 specialisation), but the graph is the same for one
    sequence or one token, which the parity tests check against transformers."""
    try:
        return exported.module(check_guards=False)
    except TypeError:  # torch before check_guards: no input guards are installed anyway
        return exported.module()


class TorchBackend:
    """ForwardBatch -> logits with the torch.export program of the artifact (cpu or cuda)."""

    def __init__(self, model_path: Path, config: dict[str, Any], num_blocks: int | None = None,
                 device: str = "cpu", threads: int | None = None, cuda_graphs: dict[str, Any] | None = None,
                 graphs: str | None = None, attention: str | None = None) -> None:
        graphs = graphs or ("off" if os.environ.get("OPTIMIZE_CUDA_GRAPHS", "1") == "0" else "auto")
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
        if device not in ("cpu", "cuda"):
            raise RuntimeError(f"the torch backend runs on cpu or cuda, not {device!r}")
        if device == "cuda":
            problem = missing_for("torch")
            if problem is not None:
                raise RuntimeError(f"{problem} (or load the artifact with device='cpu')")
            if attention == "triton":
                from runtime.kernels.paged_attention import triton_available

                if not triton_available():
                    raise RuntimeError("this artifact's attention is the Triton paged-attention kernel "
                                       "(optimize::paged_attention_triton) and triton is not installed: pip install "
                                       "triton (CUDA builds of torch ship it), or load the artifact with device='cpu'")
            if attention == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
                raise RuntimeError("this artifact's attention is FlashInfer (optimize::paged_attention_flashinfer) and "
                                   "flashinfer is not installed: pip install flashinfer-python (matching this torch "
                                   "and CUDA), or rebuild with select_attention kernel: triton, or load the artifact "
                                   "with device='cpu'")
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("this artifact's backend is torch, which is not installed: "
                               "pip install 'optimize[compiler]' (or torch)") from e
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
        self._torch = torch
        self.device = torch.device(device)
        threads = threads or int(os.environ.get("OPTIMIZE_TORCH_THREADS", "0"))
        if threads and device == "cpu":
            torch.set_num_threads(threads)
        kv_name = read_geometry(self, config, num_blocks)
        if kv_name not in _KV_DTYPES:
            raise RuntimeError(f"KV cache dtype {kv_name!r} is not supported by the torch backend "
                               f"({', '.join(_KV_DTYPES)})")
        tdtype = getattr(torch, kv_name)
        self.kv_dtype = np.dtype(kv_name) if kv_name != "bfloat16" else None  # numpy has no bfloat16
        from runtime.backends import torch_ops  # noqa: F401 (registers the custom ops the program may call)
        check_pt2(model_path)  # refuses pickles and opaque objects before torch.export.load unpickles them
        exported = torch.export.load(str(model_path))
        if device != "cpu":
            from torch.export.passes import move_to_device_pass

            exported = move_to_device_pass(exported, device)
        self.program = callable_program(exported)
        # one extra block at the end: where padded decode rows write their K/V (never scheduled)
        shape = (self.num_blocks + 1, self.block_size, self.kv_heads, self.head_dim)
        self._k = [torch.zeros(shape, dtype=tdtype, device=self.device) for _ in range(self.num_layers)]
        self._v = [torch.zeros(shape, dtype=tdtype, device=self.device) for _ in range(self.num_layers)]
        self.pad_slot = self.num_blocks * self.block_size
        if device == "cpu" and self.kv_dtype is not None:  # numpy views: copy_blocks, tests, metrics
            self.k_pools = [t[: self.num_blocks].numpy() for t in self._k]
            self.v_pools = [t[: self.num_blocks].numpy() for t in self._v]
        self._kv_args: list[Any] = []
        for k, v in zip(self._k, self._v, strict=True):
            self._kv_args += [k, v]
        slots = (self.num_blocks + 1) * self.block_size
        self._k_slots = [t.view(slots, self.kv_heads, self.head_dim) for t in self._k]
        self._v_slots = [t.view(slots, self.kv_heads, self.head_dim) for t in self._v]

        plan = cuda_graphs or {}
        self.buckets: list[int] = list(plan.get("decode_buckets") or []) if plan.get("capturable") else []
        self.width = int(plan.get("block_table_width") or 0)
        if graphs == "auto":
            graphs = "cuda" if device == "cuda" and self.buckets else "off"
        if graphs == "padded" and not self.buckets:
            raise RuntimeError("graphs='padded' needs the manifest's cuda_graphs plan (a plan_cuda_graphs pass "
                               "whose decode graph is capturable)")
        self.graph_mode = graphs if self.buckets else "off"
        self._flashinfer: Any = None
        if attention == "flashinfer" and device == "cuda":
            from runtime.kernels.flashinfer_attention import FlashInferAttention

            self._flashinfer = FlashInferAttention(
                int(config["model"]["num_heads"]), self.kv_heads, self.head_dim, self.block_size, tdtype, self.device,
                buckets=self.buckets if self.graph_mode == "cuda" else (), width=self.width)
        self._static: dict[int, dict[str, Any]] = {}
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self.graph_replays = 0  # CUDA graph replays
        self.bucket_steps = 0  # decode steps run padded to a bucket (replayed or not)
        if self.graph_mode != "off":
            self._prepare_buckets()
        log.info("torch.export program on %s, KV pool %s x %d layers, decode buckets %s (%s)", device, shape,
                 self.num_layers, self.buckets, self.graph_mode)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * sum(t[: self.num_blocks].numel() * t.element_size() for t in self._k)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer's pools, pair after pair (copy-on-write)."""
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"copy_blocks: block pair ({src}, {dst}) outside the pool of {self.num_blocks}")
        for src, dst in pairs:
            for pool in self._k + self._v:
                pool[dst].copy_(pool[src])

    # -- steps -----------------------------------------------------------------------------------
    def _step(self, args: list[Any], slots: Any) -> Any:
        """The program on device tensors, then this step's K/V into the pools; returns the logits."""
        outs = self.program(*args, *self._kv_args)
        for i in range(self.num_layers):
            self._k_slots[i].index_copy_(0, slots, outs[1 + 2 * i])
            self._v_slots[i].index_copy_(0, slots, outs[2 + 2 * i])
        return outs[0]

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run one step: returns logits [len(logits_index), vocab] float32 and writes the step's K/V."""
        torch = self._torch
        if batch.num_tokens and (int(batch.slot_mapping.min()) < 0
                                 or int(batch.slot_mapping.max()) >= self.num_blocks * self.block_size):
            raise ValueError("ForwardBatch.slot_mapping out of the KV pool's range")
        bucket = self._bucket_for(batch)
        with torch.no_grad():
            if bucket is not None:
                return self._forward_bucket(batch, bucket)
            past_blocks = max(1, -(-int(batch.past_lens.max(initial=0)) // self.block_size))
            host = [batch.input_ids, batch.positions, batch.cu_seqlens, batch.past_lens,
                    np.ascontiguousarray(batch.block_table[:, :past_blocks]), batch.logits_index]
            args = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in host]
            slots = torch.from_numpy(batch.slot_mapping).to(self.device, non_blocking=True)
            if self._flashinfer is not None:
                self._flashinfer.plan(batch.cu_seqlens, batch.past_lens, host[4])
            logits = self._step(args, slots)
            return logits.float().cpu().numpy()

    def _bucket_for(self, batch: ForwardBatch) -> int | None:
        """The decode bucket that serves this step, or None (eager)."""
        return decode_bucket(batch, self.buckets, self.width) if self.graph_mode != "off" else None

    def _prepare_buckets(self) -> None:
        """Static input buffers per bucket (device, plus pinned host mirrors on CUDA); on CUDA capture
        each bucket's step as a CUDA graph, largest first, sharing one memory pool."""
        torch = self._torch
        cuda = self.graph_mode == "cuda"
        for b in self.buckets:
            dev = {
                "input_ids": torch.zeros(b, dtype=torch.int64, device=self.device),
                "positions": torch.zeros(b, dtype=torch.int64, device=self.device),
                "cu_seqlens": torch.arange(b + 1, dtype=torch.int32, device=self.device),
                "past_lens": torch.zeros(b, dtype=torch.int32, device=self.device),
                "block_table": torch.full((b, self.width), -1, dtype=torch.int32, device=self.device),
                "logits_index": torch.arange(b, dtype=torch.int64, device=self.device),
                "slot_mapping": torch.full((b,), self.pad_slot, dtype=torch.int64, device=self.device),
            }
            host = {k: torch.empty_like(v, device="cpu").pin_memory() if cuda else v for k, v in dev.items()}
            self._static[b] = {"dev": dev, "host": host, "host_np": {k: v.numpy() for k, v in host.items()}}
        if not cuda:
            return
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for b in sorted(self.buckets, reverse=True):
                dev = self._static[b]["dev"]
                args = [dev[k] for k in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table",
                                         "logits_index")]
                if self._flashinfer is not None:  # every row padding: one entry in the spare block
                    self._flashinfer.plan(np.arange(b + 1), np.zeros(b, np.int32), np.full((b, self.width), -1),
                                          bucket=b, pad_from=0, pad_block=self.num_blocks)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up (allocator, lazy init) before capture
                    for _ in range(2):
                        self._step(args, dev["slot_mapping"])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._step(args, dev["slot_mapping"])
                self._graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (decode buckets %s)", len(self._graphs), self.buckets)

    def _forward_bucket(self, batch: ForwardBatch, b: int) -> np.ndarray:
        n = batch.num_seqs
        self.bucket_steps += 1
        st = self._static[b]
        h = st["host"]
        stage_padded_decode(st["host_np"], batch, self.num_blocks, self.block_size)
        if self._flashinfer is not None:  # refills the bucket wrapper's buffers the captured kernels read
            hn = st["host_np"]
            self._flashinfer.plan(np.arange(b + 1), hn["past_lens"], hn["block_table"],
                                  bucket=b if self.graph_mode == "cuda" else None, pad_from=n, pad_block=self.num_blocks)
        if self.graph_mode == "cuda":
            dev = st["dev"]
            for k in ("input_ids", "positions", "past_lens", "block_table", "slot_mapping"):
                dev[k].copy_(h[k], non_blocking=True)
            graph, logits = self._graphs[b]
            graph.replay()
            self.graph_replays += 1
        else:  # "padded": the same static-shape step, not captured
            args = [h[k] for k in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table",
                                   "logits_index")]
            logits = self._step(args, h["slot_mapping"])
        return logits[:n].float().cpu().numpy()
