"""Build memory: the peak RSS each pass reached (measured) and the peak each pass will need (estimated).

`RssSampler` samples the process's resident set (VmRSS, /proc/self/status) on a thread while a pass
runs; the build records the peaks per pass in build.json ("memory"). `estimate_pass_peaks` gives, from
the checkpoint's shapes only, the resident set each pass of a recipe will reach: the dry run prints it
and `build()` refuses to start when the largest exceeds the machine's MemAvailable (`check_memory`),
naming the estimate, the memory available and the pass, unless forced. The terms are what each pass
holds at its peak (docs/architecture.md, "Build memory"); the fixed overhead is the interpreter with
torch, onnx and ONNX Runtime imported, measured on the build machine kind.

`OPTIMIZE_MEMINFO` names a file to read instead of /proc/meminfo (a fake MemAvailable for tests).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib.util
import logging
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler import streamed
from compiler.checkpoint import _DTYPE_BYTES
from compiler.quant.common import SEQUENTIAL_ROLES, matches, module_of, sequential_steps
from compiler.recipe import DEFAULT_CALIBRATION_SAMPLES

if TYPE_CHECKING:  # pragma: no cover
    from compiler.checkpoint import CheckpointInfo
    from compiler.recipe import Recipe

log = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
# resident set added by the imports (measured: build.json's `memory` of random Llamas of 25M-300M parameters):
# the interpreter with the compiler before the first pass; torch (capture); onnx, onnxscript and the
# exporter (lower_onnx); ONNX Runtime (fuse's session)
START_OVERHEAD = 50 * MIB
TORCH_OVERHEAD = 425 * MIB
ONNX_OVERHEAD = 100 * MIB
ORT_OVERHEAD = 50 * MIB
FIXED_OVERHEAD = START_OVERHEAD + TORCH_OVERHEAD + ONNX_OVERHEAD + ORT_OVERHEAD
# a CUDA build of torch maps its CUDA libraries (cuBLAS, cuDNN, ...) when imported, with no GPU in use: importing
# torch 2.11+cu130 reaches 485 MiB resident against 219 MiB for 2.13+cpu
TORCH_CUDA_OVERHEAD = 270 * MIB


@functools.cache
def torch_overhead() -> int:
    """TORCH_OVERHEAD, plus TORCH_CUDA_OVERHEAD where the installed torch is a CUDA build (it ships
    libtorch_cuda.so); found from the package's files, without importing torch."""
    spec = importlib.util.find_spec("torch")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    cuda = any(Path(p, "lib", "libtorch_cuda.so").is_file() for p in places)
    return TORCH_OVERHEAD + (TORCH_CUDA_OVERHEAD if cuda else 0)


def fixed_overhead() -> int:
    """The imports' resident set with this machine's torch (FIXED_OVERHEAD with a CPU build)."""
    return FIXED_OVERHEAD - TORCH_OVERHEAD + torch_overhead()


# streamed builds (measured at 100M-1B): package's work per tensor, in units of the largest tensor in float32
# (its session check of the written file runs without prepacking: the weights stay memory-mapped, untouched)
STREAM_WORK = 3
_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of /proc/<pid>/status in kB (VmRSS, VmHWM); 0 where /proc has none."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo (or of the file OPTIMIZE_MEMINFO names), in bytes; None if unknown."""
    path = Path(os.environ.get("OPTIMIZE_MEMINFO", "/proc/meminfo"))
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def return_freed_memory() -> None:
    """Make glibc's malloc give freed blocks back to the kernel: blocks of 256 KiB and more mapped on their own
    (a fixed threshold: glibc otherwise raises it after the first free, and a build's freed tensors and protobuf
    buffers then stay in the heap, resident) and free heap pages trimmed. No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return


def trim_heap() -> None:
    """Collect garbage and hand free heap pages back to the kernel (glibc's malloc_trim); after each pass."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """The largest VmRSS seen since the last `take()`, sampled every `interval` seconds on a daemon thread."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = status_kb("VmRSS") * 1024
            with self._lock:
                self._peak = max(self._peak, rss)
            self._stop.wait(self.interval)

    def take(self) -> int:
        """The peak since the last call (at least the current RSS); starts the next window."""
        rss = status_kb("VmRSS") * 1024
        with self._lock:
            peak, self._peak = max(self._peak, rss), rss
        return peak


def _quantized_bytes(info: CheckpointInfo, passes: list[Any]) -> tuple[int, int]:
    """(parameters, stored bytes) of the weights a weight-quantize pass of `passes` replaces."""
    sizers = [ps for ps in passes if hasattr(ps, "estimated_bytes")]
    params = stored = 0
    for name, (_dtype, shape) in info.tensors.items():
        module, kind = module_of(name, shape)
        b = next((b for ps in sizers if (b := ps.estimated_bytes(module, shape, kind)) is not None), None)
        if b is not None:
            params += math.prod(shape)
            stored += b
    return params, stored


# the passes a streamed build runs (the others read or change the weights of the whole model). plan_cuda_graphs
# runs its decode buckets on zeros made during the run (ONNX) or on fake tensors (torch); build_engine writes
# TensorRT's ONNX input one weight at a time
STREAMING_PASSES = ("select_attention", "capture", "quantize_rtn", "quantize_gptq", "quantize_awq", "quantize_fp8",
                    "quantize_int8", "lower_onnx", "lower_quant", "fuse", "lower_quant_torch", "plan_cuda_graphs",
                    "build_engine", "package")
# a streamed calibration's batches (compiler/quant/calibration.py LayerRunner: dense attention) and the
# float32 tensors a decoder layer's forward holds per token, in units of (3 x intermediate + 6 x hidden)
GPTQ_BATCH_TOKENS = 4096


def _calibration_terms(recipe: Recipe, info: CheckpointInfo) -> dict[str, int]:
    """What a streamed calibration run (LayerRunner over one decoder layer read from the checkpoint) holds, in
    bytes: `weights` one decoder layer in float32, `hidden` the calibration tokens' hidden states (float32),
    `forward` the layer's forward activations of one batch, `embed` the embedding read whole (float32 and
    the checkpoint's copy) for the hidden states; `batch` and `tokens` in tokens."""
    cal = recipe.calibration
    tokens = (cal.num_samples or DEFAULT_CALIBRATION_SAMPLES) * cal.seq_len if cal is not None else 0
    cfg = info.config
    batch = min(tokens, GPTQ_BATCH_TOKENS)
    layer = [shape for n, (_dtype, shape) in info.tensors.items() if n.startswith("model.layers.0.")]
    embed = next((math.prod(shape) * (4 + _DTYPE_BYTES.get(dtype, 4)) for n, (dtype, shape) in info.tensors.items()
                  if n.endswith("embed_tokens.weight")), 0)
    return {"tokens": tokens, "batch": batch, "forward": batch * (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * 4,
            "weights": sum(math.prod(shape) for shape in layer) * 4, "hidden": tokens * cfg.hidden_size * 4,
            "embed": embed}


def gptq_streamed_bytes(recipe: Recipe, info: CheckpointInfo, options: Any) -> int:
    """What a streamed quantize_gptq with `options` (its GptqOptions) holds at its peak (compiler/passes/quantize_gptq.py): one decoder layer's
    weights in float32, the calibration hidden states (T tokens x hidden, float32, twice while a layer's output
    replaces its input), and the larger of the two phases of one true-sequential step of Linears with input
    width d: capturing (one [d, d] Hessian accumulator per distinct input in the pass's `precision`, a band of
    X^T X, a batch's inputs in float32 and in that precision and the layer's forward activations of a batch) and
    quantizing (the prepared Hessian, in place, and the other inputs' accumulators; the weight in that precision,
    permuted, and its codes), plus what the runner keeps in the steps after the attention (its output, T x
    hidden) and in down_proj's (its input, T x intermediate, float32); or,
    before the layers, the embedding table read whole (float32 and the checkpoint's copy) beside the hidden
    states, where that is more."""
    from compiler.quant.gptq import ADD_ROWS

    t = _calibration_terms(recipe, info)
    size = 8 if options.precision == "float64" else 4  # bytes per element
    layer = [(n, shape) for n, (_dtype, shape) in info.tensors.items() if n.startswith("model.layers.0.")]
    linears = {n.removesuffix(".weight"): shape for n, shape in layer if n.endswith(".weight") and len(shape) == 2}
    worst = 0
    steps = sequential_steps(list(linears))
    for k, step in enumerate(steps):
        d = max(linears[n][1] for n in step)
        out = max(linears[n][0] for n in step)
        hess = d * d * size
        # Linears of one role group share their input (one accumulator); any others have one each
        inputs = 1 if any(all(n.rsplit(".", 1)[-1] in roles for n in step) for roles in SEQUENTIAL_ROLES) \
            else len(step)
        # a batch's inputs in float32 (the module's own input: the model runs in float32) and in the precision
        capturing = (inputs * hess + min(ADD_ROWS, d) * d * size + t["batch"] * d * (4 if size == 4 else 4 + size)
                     + t["forward"])
        quantizing = inputs * hess + min(ADD_ROWS, d) * d * size + out * d * (2 * size + 1)
        changing = [n for s in steps[k:] for n in s]
        kept = 0  # what LayerRunner keeps once final: the attention's output, then the dense MLP's down_proj input
        if not any(".self_attn." in n for n in changing):
            kept += t["hidden"]
            if all(n.endswith(".mlp.down_proj") for n in changing):
                mlp_input = t["tokens"] * info.config.intermediate_size * 4
                # while capturing, the current batch's kept input is the input captured
                capturing += mlp_input - t["batch"] * d * 4
                quantizing += mlp_input
        worst = max(worst, capturing + kept, quantizing + kept)
    return max(t["weights"] + 2 * t["hidden"] + worst, t["embed"] + t["hidden"])


def awq_streamed_bytes(recipe: Recipe, info: CheckpointInfo, options: Any) -> int:
    """What a streamed quantize_awq (search: grid) with `options` (its AwqOptions) holds at its peak
    (compiler/passes/quantize_awq.py): one decoder layer's weights in float32, the calibration hidden states
    twice (the layer's output computed beside its input), every scale group's captured input (T tokens x
    (3 x hidden + intermediate), float32: q/k/v's, o's, gate/up's and down's; sequential: the worst group's)
    and the larger of the scale search of the gate/up group (the weights it tries, a copy of the originals,
    the MLP's output per token for reference and trial, and the MLP's forward activations of a batch) and the
    clip search of down_proj (its input gathered whole, the weight, its trial quantization's temporaries and
    the partial products of 256 rows over clip_tokens tokens); or, before the layers, the embedding table
    read whole beside the hidden states, where that is more."""
    t = _calibration_terms(recipe, info)
    cfg = info.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    tokens = t["tokens"]
    inputs = tokens * (inter if options.sequential else 3 * hidden + inter) * 4
    gate_up = 2 * hidden * inter * 4  # the gate/up group's weights in float32
    scale_search = 2 * gate_up + 2 * tokens * hidden * 4 + t["forward"]
    groups = -(-inter // options.group_size)
    clip_search = (tokens * inter + hidden * inter + 3 * 256 * inter
                   + 2 * 256 * min(tokens, options.clip_tokens) * groups) * 4 if options.clip else 0
    work = max(scale_search, clip_search)
    return max(t["weights"] + 2 * t["hidden"] + inputs + work, t["embed"] + t["hidden"])


# a streamed FP8 weight's quantization (compiler/quant/fp8.py quantize_weight, then dequantize for the calibration):
# the scaled and clamped copies and the dequantized weight, in units of the Linear in float32
FP8_QUANTIZE_WORK = 3


def fp8_streamed_bytes(recipe: Recipe, info: CheckpointInfo, options: Any) -> int:
    """What a streamed quantize_fp8 with `options` (its Fp8Options) holds at its peak
    (compiler/passes/quantize_fp8.py). Without calibration (activations dynamic or none) nothing: each weight is
    recorded, quantized when package writes it. Static: one decoder layer's weights in float32, the calibration
    hidden states twice (a layer's output replaces its input) and the larger of the layer's forward activations
    of a batch and one Linear's quantization (FP8_QUANTIZE_WORK x its float32 size); or, before the layers, the
    embedding read whole beside the hidden states (and its quantization, where it is not ignored), where that
    is more."""
    if options.activations != "static":
        return 0
    t = _calibration_terms(recipe, info)
    largest = max((math.prod(shape) for n, (_dtype, shape) in info.tensors.items()
                   if n.startswith("model.layers.0.") and len(shape) == 2), default=0) * 4
    embed_fp32 = next((math.prod(shape) * 4 for n, (_dtype, shape) in info.tensors.items()
                       if n.endswith("embed_tokens.weight")), 0)
    embed_work = 0 if matches("embed_tokens", options.ignore) else FP8_QUANTIZE_WORK * embed_fp32
    return max(t["weights"] + 2 * t["hidden"] + max(t["forward"], FP8_QUANTIZE_WORK * largest),
               t["embed"] + t["hidden"] + embed_work)


# a streamed INT8 weight's quantization (compiler/quant/int8.py quantize_weight): w / scale and its rounding, in
# units of the Linear in float32, beside the codes
INT8_QUANTIZE_WORK = 2


def int8_streamed_bytes(recipe: Recipe, info: CheckpointInfo, options: Any) -> int:
    """What a streamed quantize_int8 with `options` (its Int8Options) holds at its peak
    (compiler/passes/quantize_int8.py). Without SmoothQuant nothing: each weight is recorded, quantized when
    package writes it. With it: one decoder layer's weights in float32, the calibration hidden states twice (a
    layer's output replaces its input) and the larger of the layer's forward activations of a batch and one
    Linear's quantization (INT8_QUANTIZE_WORK x its float32 size); or, before the layers, the embedding read
    whole beside the hidden states, where that is more."""
    if options.smoothquant_alpha is None:
        return 0
    t = _calibration_terms(recipe, info)
    largest = max((math.prod(shape) for n, (_dtype, shape) in info.tensors.items()
                   if n.startswith("model.layers.0.") and len(shape) == 2), default=0) * 4
    return max(t["weights"] + 2 * t["hidden"] + max(t["forward"], INT8_QUANTIZE_WORK * largest),
               t["embed"] + t["hidden"])


def streaming_reason(recipe: Recipe, info: CheckpointInfo, passes: list[Any] | None = None) -> str | None:
    """None when the build can stream its weights (compiler/streamed.py: no pass holds the model's weights,
    package writes them one tensor at a time); else why it loads the whole model. A pass with a
    `streaming_problem(info)` method (its options, e.g. quantize_awq's search: fit) may say why not too."""
    cfg = info.config
    if recipe.target.matmul == "bfloat16":
        return "target matmul bfloat16: fuse's matmul_bf16 rule packs the float weights in memory"
    if recipe.quality.eval_data is not None:
        return "the quality gate compares with the float32 model, which it holds"
    if cfg.num_experts or cfg.fused_weights:
        return f"{cfg.architecture}: its checkpoint tensors are split or regrouped when loaded"
    others = [spec.name for spec in recipe.passes if spec.name not in STREAMING_PASSES]
    if others:
        return f"pass {others[0]!r} reads or changes the weights of the whole model"
    for ps in passes or []:
        problem = ps.streaming_problem(info) if hasattr(ps, "streaming_problem") else None
        if problem is not None:
            return problem
    return None


def estimate_pass_peaks(recipe: Recipe, info: CheckpointInfo, passes: list[Any], streamed: bool = False
                        ) -> dict[str, int]:
    """The resident set (bytes) at the end of each pass of the build, from the checkpoint's shapes.

    Loaded weights: the resident set of a build only grows (what a pass frees is mostly reused by the next,
    not returned), so each pass adds what it keeps: `capture` the torch imports and W (the model's weights in
    the target dtype), a quantize pass the unpacked codes of the weights it quantizes (one byte per weight;
    plus the quality gate's reference copy W), `lower_onnx` the exporter's imports and the ONNX model (a copy
    of W), `lower_quant` its per-tensor conversions (0.7 W), `fuse` ONNX Runtime and its session of the fused
    graph (1.5 x the lowered model).

    Streamed weights (compiler/streamed.py): the passes up to fuse add only their imports (the graph holds no
    weights; quantize_gptq, quantize_awq, quantize_fp8 with static activations and quantize_int8 with SmoothQuant
    hold one decoder layer and its calibration working set while they run, `gptq_streamed_bytes` /
    `awq_streamed_bytes` / `fp8_streamed_bytes` / `int8_streamed_bytes`, and free it); package holds its
    per-tensor work (`package_streamed_bytes`); its ONNX Runtime session check of the written artifact does not
    prepack, so the file's weights stay memory-mapped and untouched. plan_cuda_graphs' bucket runs make each
    weight as zeros when the run reaches it (ONNX: two of the largest at a time) or run on fake tensors (torch).

    The coefficients are measured (build.json's `memory`) on random Llamas of 25M-1B parameters
    (docs/architecture.md, "Build memory")."""
    nbytes = _FLOAT_BYTES.get(recipe.target.dtype, 4)
    weights = info.num_parameters * nbytes
    q_params, q_stored = _quantized_bytes(info, passes)
    onnx = weights - q_params * nbytes + q_stored  # the lowered model after lower_quant
    gate = recipe.quality.eval_data is not None
    resident = START_OVERHEAD
    out: dict[str, int] = {}
    for ps in passes:
        if ps.name == "capture":
            resident += torch_overhead() + (0 if streamed else weights)
        elif ps.name == "quantize_gptq" and streamed:  # one layer at a time, its codes spilled to disk
            out[ps.name] = resident + gptq_streamed_bytes(recipe, info, ps.config)
            continue
        elif ps.name == "quantize_awq" and streamed:  # one layer at a time, its codes spilled to disk
            out[ps.name] = resident + awq_streamed_bytes(recipe, info, ps.config)
            continue
        elif ps.name == "quantize_int8" and streamed:  # recorded; SmoothQuant reads one layer at a time
            out[ps.name] = resident + int8_streamed_bytes(recipe, info, ps.config)
            continue
        elif ps.name == "quantize_fp8" and streamed:  # recorded; a static calibration reads one layer at a time
            out[ps.name] = resident + fp8_streamed_bytes(recipe, info, ps.config)
            continue
        elif hasattr(ps, "estimated_bytes"):
            resident += 0 if streamed else q_params + (weights if gate else 0)
        elif ps.name == "lower_onnx":
            resident += ONNX_OVERHEAD + (0 if streamed else weights)
        elif ps.name == "lower_quant":
            resident += 0 if streamed else int(0.7 * weights)
        elif ps.name == "fuse":
            resident += ORT_OVERHEAD + (0 if streamed else int(1.5 * onnx))
        elif ps.name == "plan_cuda_graphs" and streamed and (
                recipe.target.backend == "tensorrt" or (recipe.target.backend, recipe.target.device) == ("onnxruntime", "cpu")):
            # the bucket runs' ONNX Runtime session: each weight made as zeros when used (two at a time); not on
            # onnxruntime/cuda, whose attention (com.microsoft.PagedAttention) has no CPU kernel to run
            largest = max((math.prod(shape) for _dtype, shape in info.tensors.values()), default=0)
            out[ps.name] = resident + ORT_OVERHEAD + 2 * largest * nbytes
            continue
        elif ps.name == "package" and streamed:
            out[ps.name] = resident + package_streamed_bytes(info, passes, recipe.target.backend != "torch")
            continue
        out[ps.name] = resident
    return out


def package_streamed_bytes(info: CheckpointInfo, passes: list[Any], chunked: bool = True) -> int:
    """What a streamed package holds at its peak: STREAM_WORK x the largest checkpoint tensor it computes whole in
    float32 (a quantized weight: the tensor, its quantization's temporaries, the packed result), or a chunk of
    rows of a large float tensor it writes as the checkpoint holds it (the embedding, a kept lm_head:
    streamed.written_in_chunks; the chunk read and converted, 2 x streamed.CHUNK_BYTES). `chunked` False: model.pt2
    (compiler/streamed_pt2.py), whose records are written whole."""
    sizers = [ps for ps in passes if hasattr(ps, "estimated_bytes")]
    worst = 0
    for name, (_dtype, shape) in info.tensors.items():
        f32 = math.prod(shape) * 4
        module, kind = module_of(name, shape)
        quantized = any(ps.estimated_bytes(module, shape, kind) is not None for ps in sizers)
        whole = quantized or len(shape) < 2 or f32 <= streamed.CHUNK_BYTES or not chunked
        worst = max(worst, STREAM_WORK * f32 if whole else 2 * streamed.CHUNK_BYTES)
    return worst


def _needs_torch_model(recipe: Recipe, later: list[str], gate: bool) -> bool:
    """Whether a pass still to run, the torch target's package or the quality gate reads the torch model."""
    if gate or recipe.target.backend != "onnxruntime":
        return True
    return any(n.startswith("quantize_") or n in ("capture", "lower_onnx", "lower_quant", "plan_cuda_graphs")
               for n in later)


def release_torch_model(recipe: Recipe, artifacts: dict[str, Any], later: list[str]) -> bool:
    """Drop the torch model and its exported program once nothing later reads them; True when dropped."""
    if "onnx" not in artifacts or "model" not in artifacts:
        return False
    if _needs_torch_model(recipe, later, recipe.quality.eval_data is not None):
        return False
    for key in ("model", "exported", "example_inputs"):
        artifacts.pop(key, None)
    return True


def check_memory(estimates: dict[str, int], force: bool = False) -> str | None:
    """None when the largest pass estimate fits MemAvailable (or it is unknown, or `force`); else the reason."""
    if not estimates:
        return None
    name, need = max(estimates.items(), key=lambda kv: kv[1])
    have = mem_available()
    if have is None or need <= have:
        return None
    return refuse_unless_forced(
        f"the build needs an estimated {need / GIB:.2f} GiB at pass {name!r}, but this machine has "
        f"{have / GIB:.2f} GiB available (MemAvailable)",
        "use a smaller recipe, free memory, or pass --force to build anyway", force)


def refuse_unless_forced(message: str, remedy: str, force: bool) -> str | None:
    """The reason to refuse a build (`message`; `remedy`), or None after a warning when `force`."""
    if force:
        log.warning("%s; building anyway (forced)", message)
        return None
    return f"{message}; {remedy}"
