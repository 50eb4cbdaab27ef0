"""TensorRT engine build: the lowered ONNX graph -> a serialized TensorRT engine for this machine's GPU.

Target tensorrt/cuda only; runs after lower_onnx (and lower_quant, plan_cuda_graphs), on the build
machine's GPU. Steps:

1. The graph is checked against TensorRT's ONNX support table (compiler/trt/onnx_support.py) after the
   two exact rewrites our exporter needs (integer Clip -> Max/Min, boolean Equal -> Not(Xor)); any node
   left that TensorRT cannot read fails the build here, naming the nodes.
2. TensorRT's ONNX parser reads the graph from a temporary folder (weights as external data, so
   models over 2 GB parse too) into a strongly typed network: every tensor keeps the element type the
   graph gives it, as the CPU targets compute it (float16/bfloat16 weights and activations, the float32
   RMSNorm and softmax islands, explicit Q/DQ). `strongly_typed: false` instead lets TensorRT choose
   precisions with the target dtype as a builder flag (FP16 / BF16); a Q/DQ graph needs the strongly
   typed form. float32 runs without TF32 unless `tf32: true`.
3. Optimization profiles (compiler/trt/profiles.py): `mixed` (prefill and mixed steps), `decode`, and
   one per CUDA-graph decode bucket of plan_cuda_graphs, from the recipe's serving limits.
4. The timing cache (`timing_cache: <file>`, relative to the recipe) seeds tactic selection; the
   updated cache ships in the artifact (timing.cache) so a rebuild on the same GPU can reuse it.

The serialized engine goes to ctx.artifacts["engine_plan"] (written by package as model.plan), the
timing cache to ctx.artifacts["timing_cache"], and the engine record (TensorRT version, GPU, compute
capability, profiles, ...) to ctx.artifacts["engine_record"] and the pass's stats; the runtime refuses
an engine built for another GPU or TensorRT version with it. An engine is specific to the GPU and the
TensorRT version; its bytes also vary between builds (tactic timing), unlike the ONNX targets' payload.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from compiler import streamed
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.passes.package import ENGINE_FILE, TIMING_CACHE_FILE
from compiler.trt import EngineLimits, engine_profiles, has_qdq, legalize, unsupported_nodes
from runtime.backends.tensorrt import dtype_name, present_machine, trt_logger
from runtime.gpu import missing_for

log = logging.getLogger(__name__)

INT4_PASSES = ("quantize_rtn", "quantize_awq", "quantize_gptq")
_TRT_DTYPE_FLAGS = {"float16": "FP16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class BuildEngineOptions:
    workspace_gib: float = 4.0  # builder workspace pool limit (GiB)
    optimization_level: int = 3  # TensorRT builder optimization level 0..5 (higher: longer build, faster engine)
    timing_cache: str | None = None  # a timing cache file to start from (relative to the recipe's folder)
    strongly_typed: bool = True  # false: weakly typed, the target dtype as a builder flag (no Q/DQ graphs)
    tf32: bool = False  # float32 target: allow TF32 matmuls (faster, ~1e-3 relative error)
    graph_profiles: bool = True  # one profile per CUDA-graph decode bucket (needs plan_cuda_graphs before)

    def __post_init__(self) -> None:
        if not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level must be 0..5, got {self.optimization_level}")
        if not self.workspace_gib > 0:
            raise ValueError(f"workspace_gib must be > 0, got {self.workspace_gib}")


def timing_cache_path(recipe: Any, written: str) -> Path:
    return (Path(recipe.path).resolve().parent / Path(written).expanduser()).resolve()


class BuildEnginePass(Pass):
    """Compile the ONNX graph into a TensorRT engine (model.plan) with the serving profiles."""

    name: ClassVar[str] = "build_engine"
    Config = BuildEngineOptions
    requires = ("lower_onnx",)
    summary = "ONNX -> TensorRT engine (profiles for mixed, decode and each CUDA-graph bucket; timing cache)"

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        t = recipe.target
        if t.backend != "tensorrt":
            return ("name", f"build_engine compiles TensorRT engines; the target is {t.backend}/{t.device} "
                            "(remove the pass, or set target.backend: tensorrt)")
        names = [spec.name for spec in recipe.passes]
        me = names.index(self.name)
        for i, spec in enumerate(recipe.passes):
            if spec.name == "fuse":
                return ("name", f"passes[{i}] 'fuse' rewrites the graph into ONNX Runtime contrib ops "
                                "(com.microsoft.*), which TensorRT's ONNX parser cannot read: remove it for the "
                                "tensorrt target")
            if spec.name == "quantize_kv_cache":
                return ("name", f"passes[{i}] 'quantize_kv_cache' stores the KV pools as int8 / E4M3 bytes; the "
                                "TensorRT backend keeps float pools: remove it for the tensorrt target")
            if spec.name == "select_attention" and spec.options.get("kernel", "auto") in ("gqa", "paged_attention"):
                return ("name", f"passes[{i}] 'select_attention' forces kernel {spec.options['kernel']!r}, an ONNX "
                                "Runtime contrib op TensorRT's ONNX parser cannot read: use kernel: decomposed or auto")
            if spec.name in ("lower_quant", "plan_cuda_graphs") and i > me:
                return ("name", f"build_engine must come after passes[{i}] '{spec.name}' (the engine is built "
                                "from the final graph" + (" and its decode buckets)" if spec.name == "plan_cuda_graphs"
                                                          else ")"))
        int4 = [(i, n) for i, n in enumerate(names) if n in INT4_PASSES]
        if int4:
            i, n = int4[0]
            spec = recipe.passes[i]
            lq = next((p for p in recipe.passes if p.name == "lower_quant"), None)
            fmt = lq.options.get("int4_format", "matmulnbits") if lq is not None else "matmulnbits"
            if n == "quantize_awq" or not spec.options.get("symmetric", False):
                how = ("AWQ has no symmetric mode here: use quantize_rtn or quantize_gptq with symmetric: true"
                       if n == "quantize_awq" else f"set passes[{i}].options.symmetric: true")
                return ("name", f"TensorRT dequantizes INT4 only symmetric (signed int4, zero point 0) and "
                                f"passes[{i}] '{n}' stores asymmetric uint4 with zero points: {how}, or use "
                                "quantize_fp8")
            if fmt != "qdq":
                return ("name", "lower_quant's int4_format 'matmulnbits' emits com.microsoft.MatMulNBits, an ONNX "
                                "Runtime contrib op TensorRT's ONNX parser cannot read: set lower_quant's "
                                "int4_format: qdq (signed int4 DequantizeLinear) for the tensorrt target")
        if self.config.timing_cache is not None:
            path = timing_cache_path(recipe, self.config.timing_cache)
            if not path.is_file():
                return ("options.timing_cache", f"timing cache file not found: {path} (take timing.cache from an "
                                                "artifact built on this GPU, or leave the option out)")
        return None

    def check_environment(self, recipe: Any) -> str | None:
        return missing_for("tensorrt")

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import tensorrt as trt

        model, rewritten = self._legalized_graph(ctx)
        limits, profiles = self._profiles(ctx, model)
        strongly = self.config.strongly_typed
        machine = present_machine()

        logger = trt_logger(trt)
        builder = trt.Builder(logger)
        # the parser holds the weights the network refers to: it lives until the engine is built
        network, parser, parse_s = _parse(trt, builder, logger, model, strongly)
        config, precision_flags, cache_in = self._builder_config(trt, builder, ctx, profiles, machine)
        engine_bytes, cache_out, build_s, layers, io = _build(trt, builder, network, config, logger, model)

        record: dict[str, Any] = {
            "tensorrt_version": machine["tensorrt_version"] or str(trt.__version__),
            "gpu": machine["gpu"],
            "compute_capability": machine["compute_capability"],
            "engine_file": ENGINE_FILE,
            "engine_bytes": len(engine_bytes),
            "layers": layers,
            "dtype": ctx.recipe.target.dtype,
            "strongly_typed": bool(strongly),
            "precision_flags": precision_flags,
            "optimization_level": self.config.optimization_level,
            "workspace_bytes": int(self.config.workspace_gib * (1 << 30)),
            "limits": limits.record(),
            "profiles": [p.record() for p in profiles],
            "io": io,
            "legalized": rewritten,
            "timing_cache": {"file": TIMING_CACHE_FILE, "seeded_from": self.config.timing_cache},
        }
        ctx.artifacts["engine_plan"] = engine_bytes
        ctx.artifacts["timing_cache"] = cache_out
        ctx.artifacts["engine_record"] = record
        ctx.build_info["build_engine"] = {
            "parse_s": round(parse_s, 3), "build_s": round(build_s, 3),
            "timing_cache_bytes_in": len(cache_in), "timing_cache_bytes_out": len(cache_out),
            "timing_cache_path": str(timing_cache_path(ctx.recipe, self.config.timing_cache))
            if self.config.timing_cache else None,
        }
        log.info("TensorRT engine: %d layers, %d bytes, %d profiles, built in %.1f s", record["layers"],
                 len(engine_bytes), len(profiles), build_s)
        return record

    def _legalized_graph(self, ctx: BuildContext) -> tuple[Any, Any]:
        """The graph (after the passes it must follow) with the exact rewrites TensorRT needs; a node TensorRT's
        ONNX parser cannot read fails the build, named. (the graph, what legalize rewrote)"""
        names = [p.name for p in ctx.recipe.passes]
        for before in ("lower_quant", "plan_cuda_graphs"):
            if before in names and before not in ctx.completed:
                raise BuildError(f"build_engine must come after {before!r}")
        model = ctx.require("onnx", self.name)
        rewritten = legalize(model)
        problems = unsupported_nodes(model)
        if problems:
            shown = "; ".join(f"{p['node']}: {p['reason']}" for p in problems[:8])
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise BuildError(f"build_engine: TensorRT's ONNX parser cannot read {len(problems)} node(s): {shown}{more}")
        return model, rewritten

    def _profiles(self, ctx: BuildContext, model: Any) -> tuple[Any, list[Any]]:
        """The engine's limits from the recipe's serving limits, and its optimization profiles (mixed, decode and
        one per CUDA-graph decode bucket); a Q/DQ graph must be strongly typed."""
        rt = ctx.recipe.runtime
        cfg = ctx.checkpoint.config
        max_len = ctx.max_model_len
        limits = EngineLimits(rt.max_num_batched_tokens, rt.max_num_seqs, math.ceil(max_len / rt.kv_block_size),
                              rt.num_kv_blocks, rt.kv_block_size, cfg.num_kv_heads, cfg.head_dim)
        plan = ctx.artifacts.get("cuda_graphs") or {}
        buckets = list(plan.get("decode_buckets") or []) if self.config.graph_profiles and plan.get("applies") else []
        profiles = engine_profiles([i.name for i in model.graph.input], limits, buckets)
        if has_qdq(model) and not self.config.strongly_typed:
            raise BuildError("build_engine: the graph holds Q/DQ nodes (explicit quantization); it needs "
                             "strongly_typed: true")
        return limits, profiles

    def _builder_config(self, trt: Any, builder: Any, ctx: BuildContext, profiles: list[Any],
                        machine: dict[str, Any]) -> tuple[Any, list[str], bytes]:
        """The builder config: workspace, optimization level, precision flags, the timing cache it starts from,
        the profiles and the progress monitor. (config, the precision flags set, the timing cache's bytes)"""
        dtype = ctx.recipe.target.dtype
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.config.workspace_gib * (1 << 30)))
        config.builder_optimization_level = self.config.optimization_level
        precision_flags: list[str] = []
        if not self.config.strongly_typed and dtype in _TRT_DTYPE_FLAGS:
            config.set_flag(getattr(trt.BuilderFlag, _TRT_DTYPE_FLAGS[dtype]))
            precision_flags.append(_TRT_DTYPE_FLAGS[dtype])
        if self.config.tf32:
            config.set_flag(trt.BuilderFlag.TF32)
            precision_flags.append("TF32")
        else:
            config.clear_flag(trt.BuilderFlag.TF32)
        cache_in = b""
        if self.config.timing_cache is not None:
            cache_in = timing_cache_path(ctx.recipe, self.config.timing_cache).read_bytes()
        cache = config.create_timing_cache(cache_in)
        if not config.set_timing_cache(cache, False):
            raise BuildError(f"build_engine: timing cache {self.config.timing_cache} does not match this GPU or "
                             f"TensorRT version (TensorRT {machine['tensorrt_version']}, {machine['gpu']})")
        for p in profiles:
            prof = builder.create_optimization_profile()
            for name, (lo, opt, hi) in p.shapes.items():
                prof.set_shape(name, tuple(lo), tuple(opt), tuple(hi))
            config.add_optimization_profile(prof)
        bar = ctx.artifacts.get("progress")
        if bar is not None and hasattr(trt, "IProgressMonitor"):
            config.progress_monitor = _progress_monitor(trt, bar)
        return config, precision_flags, cache_in


def _parse(trt: Any, builder: Any, logger: Any, model: Any, strongly: bool) -> tuple[Any, Any, float]:
    """The graph read by TensorRT's ONNX parser into a network (strongly typed unless `strongly` is false), from
    a temporary folder. (network, parser, seconds)"""
    import onnx

    flags = (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)) if strongly else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="optimize-trt-") as tmp:
        onnx_path, streamed = write_parser_input(model, Path(tmp))
        try:
            parsed = parser.parse_from_file(str(onnx_path))
        finally:
            if not streamed:  # save_model moved the weights out of the in-memory proto: read them back
                onnx.external_data_helper.load_external_data_for_model(model, tmp)
    if not parsed:
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)] or logger.errors[-5:]
        raise BuildError("build_engine: TensorRT's ONNX parser refused the graph: " + "; ".join(errors[:8]))
    return network, parser, time.perf_counter() - t0


def _build(trt: Any, builder: Any, network: Any, config: Any, logger: Any, model: Any
           ) -> tuple[bytes, bytes, float, int, dict[str, dict[str, str]]]:
    """The engine built, and deserialized again to check its I/O against the graph's. (its bytes, the updated
    timing cache, seconds, its layers, its I/O tensors)"""
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("build_engine: TensorRT could not build the engine: "
                         + ("; ".join(logger.errors[-5:]) or "no reason given"))
    engine_bytes = bytes(memoryview(serialized))
    cache_out = bytes(memoryview(config.get_timing_cache().serialize()))
    build_s = time.perf_counter() - t0
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    if engine is None:
        raise BuildError("build_engine: the built engine does not deserialize: " + "; ".join(logger.errors[-3:]))
    return engine_bytes, cache_out, build_s, int(engine.num_layers), _engine_io(trt, engine, model)


def _engine_io(trt: Any, engine: Any, model: Any) -> dict[str, dict[str, str]]:
    """The engine's I/O tensors (mode and dtype), which must be the graph's."""
    io = {}
    for i in range(engine.num_io_tensors):
        n = engine.get_tensor_name(i)
        io[n] = {"mode": "input" if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT else "output",
                 "dtype": dtype_name(engine.get_tensor_dtype(n))}
    graph_io = [i.name for i in model.graph.input] + [o.name for o in model.graph.output]
    if sorted(io) != sorted(graph_io):
        raise BuildError(f"build_engine: engine I/O {sorted(io)} differs from the graph's {sorted(graph_io)}")
    return io


def write_parser_input(model: Any, folder: Path) -> tuple[Path, int]:
    """The graph TensorRT's ONNX parser reads: folder/model.onnx with its weights as external data in
    folder/model.onnx.data (the parser resolves it next to the file, so models over 2 GB parse too). A streamed
    build's weights (compiler/streamed.py) are computed and written one at a time, in the layout onnx.save_model
    writes, and stay out of the in-memory graph. (the .onnx path, the number of weights streamed)"""
    import onnx

    path = folder / "model.onnx"
    if streamed.streamed_count(model):
        return path, streamed.save_model(model, path, "model.onnx.data", 1024)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024, convert_attribute=False)
    return path, 0


def _parser_error(error: Any) -> str:
    """One ONNX parser error: its description and the node it is about."""
    if hasattr(error, "desc"):
        node = error.node_name() if hasattr(error, "node_name") else error.node()
        return f"{error.desc()} (node {node})"
    return str(error)


def _progress_monitor(trt: Any, bar: Any) -> Any:
    """TensorRT build phases as tasks of the build's rich progress display."""

    class _Monitor(trt.IProgressMonitor):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.tasks: dict[str, Any] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.tasks[phase_name] = bar.add_task(f"tensorrt: {phase_name}", total=max(1, num_steps))

        def step_complete(self, phase_name: str, step: int) -> bool:
            task = self.tasks.get(phase_name)
            if task is not None:
                bar.update(task, completed=step + 1)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            task = self.tasks.pop(phase_name, None)
            if task is not None:
                bar.remove_task(task)

    return _Monitor()


__all__ = ["ENGINE_FILE", "TIMING_CACHE_FILE", "BuildEngineOptions", "BuildEnginePass", "write_parser_input"]
