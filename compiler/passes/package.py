"""Packaging: write the model (ONNX with external weights, the torch.export program for the torch
target, or the TensorRT engine and its timing cache for the tensorrt target), the tokenizer (as
transformers resolves it, checked for parity with transformers: compiler/tokenizer.py) and
runtime.json.

The manifest itself is written by the build driver (compiler/build.py) through runtime/artifact.py
once every pass and the quality gate have run, so it lists every payload file with its sha256.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from compiler import streamed
from compiler.attention import kv_write
from compiler.export import graph_io_names
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.streamed_pt2 import deferred_by_storage, save_program
from compiler.tokenizer import TokenizerParityError, write_tokenizer
from runtime.kernels.paged_attention_cpu import uses_kernel

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
TORCH_MODEL_FILE = "model.pt2"  # torch.export.save of the captured program (its weights as raw records beside it)
ENGINE_FILE = "model.plan"  # the serialized TensorRT engine (weights inside), from build_engine
TIMING_CACHE_FILE = "timing.cache"  # TensorRT's timing cache of that build (seeds a rebuild on the same GPU)


@dataclass(frozen=True)
class PackageOptions:
    external_data_threshold: int = 1024  # tensors at least this many bytes go to model.onnx.data
    # "transformers": tokenizer/ holds the pipeline, special tokens and chat template that
    # transformers.AutoTokenizer resolves for the checkpoint; "file": the checkpoint's files as found.
    # Either way the build fails when the artifact's ids differ from transformers' on the parity sample.
    tokenizer: Literal["transformers", "file"] = "transformers"


def runtime_config(ctx: BuildContext) -> dict[str, Any]:
    """runtime.json: serving defaults from the recipe plus the model facts the runtime needs."""
    cfg = ctx.checkpoint.config
    rt = ctx.recipe.runtime
    inputs, outputs = graph_io_names(cfg.num_layers)
    onnx_model = ctx.artifacts.get("onnx")
    custom_ops: list[str] = []
    if onnx_model is not None and ctx.recipe.target.backend == "onnxruntime":
        outputs = [o.name for o in onnx_model.graph.output]  # the fuse rule rotary_attention drops new K/V
        # the package's custom-op library serves the `optimize` domain; the backend registers it for these
        custom_ops = sorted({o.domain for o in onnx_model.opset_import} & {"optimize"})
    return {
        "backend": ctx.recipe.target.backend,
        "device": ctx.recipe.target.device,
        "model_file": {"torch": TORCH_MODEL_FILE, "tensorrt": ENGINE_FILE}.get(ctx.recipe.target.backend, MODEL_FILE),
        "kv_cache": {
            "block_size": rt.kv_block_size,
            "num_blocks": rt.num_kv_blocks,
            "dtype": ctx.artifacts.get("kv_cache_dtype", ctx.recipe.target.dtype),  # set by lower_quant
        },
        "scheduler": {
            "max_num_seqs": rt.max_num_seqs,
            "max_num_batched_tokens": rt.max_num_batched_tokens,
            "max_model_len": ctx.max_model_len,
        },
        "model": {
            "architecture": cfg.architecture,
            "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": list(cfg.eos_token_ids),
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        # kv_write "graph": the attention node writes the step's K/V into the pools itself (paged_cpu,
        # paged_attention); "runtime": the backend scatters the graph's new K/V outputs at slot_mapping
        "graph": {"inputs": inputs, "outputs": outputs, "kv_write": kv_write(ctx.artifacts.get("attention")),
                  "custom_op_domains": custom_ops},
    }


def check_session(model_path: Any, kernel: bool) -> str:
    """Load the written model in an ONNX Runtime CPU session (fuse's check, for a graph whose weights were
    streamed to the file); BuildError if it does not load. Without prepacking, so the file's weights stay
    memory-mapped and untouched: the check's memory does not grow with the artifact."""
    from compiler.fusion.pipeline import load_in_cpu_session

    try:
        load_in_cpu_session(str(model_path), kernel, prepack=False)
    except Exception as e:
        raise BuildError(f"package: the written model does not load in ONNX Runtime: {str(e).splitlines()[0]}") from e
    return "loads (CPUExecutionProvider)"


class PackagePass(Pass):
    """Write the payload files of the artifact into the staging folder."""

    name: ClassVar[str] = "package"
    Config = PackageOptions
    requires = ("capture",)
    summary = ("model.onnx + model.onnx.data (model.pt2 for the torch target, model.plan + timing.cache for "
               "tensorrt), tokenizer/, runtime.json")

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        if recipe.target.backend == "tensorrt":
            names = [spec.name for spec in recipe.passes]
            if "build_engine" not in names[:names.index(self.name)]:
                return ("name", "target tensorrt/cuda needs 'build_engine' before 'package' (it compiles the "
                                "engine the artifact ships)")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        out = ctx.staging
        out.mkdir(parents=True, exist_ok=True)
        # the tokenizer (transformers' resolution and the parity check) on a thread while the model is written
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer = pool.submit(write_tokenizer, ctx.checkpoint.path, ctx.checkpoint.tokenizer_files,
                                    out / "tokenizer", source=self.config.tokenizer)
            model_file, weights_file, extra = self._write_model(ctx, out)
            try:
                ctx.artifacts["tokenizer"] = tokenizer.result()
            except TokenizerParityError as exc:
                raise BuildError(str(exc)) from exc
        (out / "runtime.json").write_text(
            json.dumps(runtime_config(ctx), sort_keys=True, indent=2) + "\n", encoding="utf-8"
        )
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        return {
            "model_file": model_file,
            "weights_file": weights_file,
            "weights_bytes": (out / weights_file).stat().st_size,
            "tokenizer_files": sorted(f.name for f in ctx.checkpoint.tokenizer_files),
            "tokenizer_source": ctx.artifacts["tokenizer"]["source"],
            "files": files,
            **extra,
        }

    def _write_model(self, ctx: BuildContext, out: Path) -> tuple[str, str, dict[str, Any]]:
        """The model (and weights) files in `out`: (model file, weights file, package's extra stats)."""
        extra: dict[str, Any] = {}
        if ctx.recipe.target.backend == "torch":
            import torch

            exported = ctx.require("exported", self.name)
            deferred = ctx.artifacts.get("deferred_params")
            if deferred:  # a streamed build: each weight computed and written in turn
                extra["streamed_tensors"] = save_program(exported, out / TORCH_MODEL_FILE,
                                                         deferred_by_storage(deferred))
            else:
                torch.export.save(exported, str(out / TORCH_MODEL_FILE))
            model_file, weights_file = TORCH_MODEL_FILE, TORCH_MODEL_FILE
        elif ctx.recipe.target.backend == "tensorrt":  # the engine holds the weights; no ONNX is shipped
            (out / ENGINE_FILE).write_bytes(ctx.require("engine_plan", self.name))
            (out / TIMING_CACHE_FILE).write_bytes(ctx.require("timing_cache", self.name))
            model_file, weights_file = ENGINE_FILE, ENGINE_FILE
        else:
            import onnx

            model = ctx.require("onnx", self.name)
            if streamed.streamed_count(model):  # weights computed and written one tensor at a time
                extra["streamed_tensors"] = streamed.save_model(model, out / MODEL_FILE, WEIGHTS_FILE,
                                                                self.config.external_data_threshold)
                if ctx.artifacts.pop("session_check_pending", False):
                    extra["onnxruntime_session"] = check_session(out / MODEL_FILE, uses_kernel(model))
            else:
                onnx.save_model(
                    model,
                    str(out / MODEL_FILE),
                    save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE,
                    size_threshold=self.config.external_data_threshold,
                    convert_attribute=False,
                )
            model_file, weights_file = MODEL_FILE, WEIGHTS_FILE
        return model_file, weights_file, extra
