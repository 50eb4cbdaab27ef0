"""Build memory and time at the sizes users bring: random Llama checkpoints, one build per row.

Each row makes (or reuses) a random Llama checkpoint of a public shape (bf16 safetensors, sharded at
2 GB, the demo tokenizer: vocab 4096, as TinyLlama's shape with a small vocabulary), runs
`optimize build --no-autotune` on it in a subprocess and samples the process's VmRSS every 50 ms
(VmHWM at the end), killing the build when it passes `--limit-gb`. Beside it: the dry run's estimate of
the build's peak (compiler/memory.py) and the per-pass peaks the build itself recorded in build.json.

Reference rows (`--references ort-genai,llama.cpp`), measured the same way on the same checkpoint with the
peer benchmark's environment (../shared/peers/setup.sh; `--peers-home`, default $PEERS_HOME): ONNX Runtime
GenAI's model builder to INT4 (`-p int4 -e cpu`), and llama.cpp's convert_hf_to_gguf to bf16 followed by
llama_model_quantize to q4_0 (two processes: the peak is the larger, the wall time the sum).

    PYTHONPATH=$PWD python bench/build_scale.py --shapes 100m,1b --methods rtn --out /tmp/bigmodels
    PYTHONPATH=$PWD python bench/build_scale.py --shapes 1b --methods rtn --references ort-genai,llama.cpp
    PYTHONPATH=$PWD python bench/build_scale.py --shapes 1b --methods gptq --calib-samples 16 --calib-seq-len 512
    PYTHONPATH=$PWD python bench/build_scale.py --shapes 100m --methods fp8,fp8-static
    PYTHONPATH=$PWD python bench/build_scale.py --shapes 1b --methods rtn,gptq --targets torch,torch-cuda-bf16

GPTQ, AWQ, int8-smoothquant and fp8-static rows calibrate on the demo's calib.txt (`--calib-samples` windows of `--calib-seq-len`
tokens); fp8 rows quantize the activations per token in the graph (no calibration).

Prints a table and writes JSON (bench/results/build_scale.json by default). Run it on a quiet machine;
the wall time includes Python and torch start-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from compiler.memory import status_kb

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"  # the peer benchmark's harness (to_gguf.py)
REFERENCES = ("ort-genai", "llama.cpp")
QUANTIZE_GGUF = ("import ctypes, sys, llama_cpp as L\n"
                 "p = L.llama_model_quantize_default_params(); p.nthread = 2; p.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0\n"
                 "sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
DEMO_MODEL = ROOT / "models" / "pycode-llama-6m"

# hidden, layers, heads, kv heads, intermediate (vocab 4096: the demo tokenizer's)
SHAPES: dict[str, dict[str, int]] = {
    "25m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1408),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048),
    "300m": dict(hidden_size=1024, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632),  # TinyLlama-1.1B
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192),  # Llama-3.2-3B
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),  # Llama-3.1-8B
    # Llama-3.1-8B with its vocabulary (8.0 B parameters: embedding and lm_head 525 M each)
    "8b-128k": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256),
}
VOCAB = 4096  # unless the shape sets vocab_size (the tokenizer is the demo's either way)
SHARD_BYTES = 2 << 30

METHODS = {
    "rtn": "  - name: quantize_rtn\n    options: {group_size: 128, ignore: [lm_head]}\n",
    "gptq": "  - name: quantize_gptq\n    options: {group_size: 128, ignore: [lm_head]}\n",
    "awq": "  - name: quantize_awq\n    options: {group_size: 128, ignore: [lm_head]}\n",
    # FP8 E4M3 weights per channel (lm_head and the embedding kept): activations per token in the graph, or
    # per tensor from calibration (static)
    "fp8": "  - name: quantize_fp8\n    options: {weights: per_channel, activations: dynamic}\n",
    "fp8-static": "  - name: quantize_fp8\n    options: {weights: per_channel, activations: static}\n",
    # INT8 W8A8 (per-channel weights, per-token activations, lm_head kept), plain or with SmoothQuant
    "int8": "  - name: quantize_int8\n",
    "int8-smoothquant": "  - name: quantize_int8\n    options: {smoothquant_alpha: 0.5}\n",
    "fp32": "",
}
CALIBRATED = ("gptq", "awq", "int8-smoothquant", "fp8-static")  # the methods that read calibration data
# the build targets of a row: (backend, device, dtype); torch writes model.pt2 (INT4 / FP8 through lower_quant_torch)
TARGETS = {"onnxruntime": ("onnxruntime", "cpu", "float32"), "onnxruntime-cuda-fp16": ("onnxruntime", "cuda", "float16"),
           "torch": ("torch", "cpu", "float32"), "torch-cuda-bf16": ("torch", "cuda", "bfloat16")}
TORCH_METHODS = ("rtn", "gptq", "awq", "fp8", "fp8-static", "fp32")
CALIBRATION_DATA = DEMO_MODEL / "calib.txt"


def _tensor_shapes(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    vocab = shape.get("vocab_size", VOCAB)
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)), (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                (f"{p}.mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def write_random_llama(out: Path, shape_name: str, seed: int = 0) -> Path:
    """A random Llama checkpoint of `shape_name` in `out` (bf16 safetensors, shards of 2 GB, the demo
    tokenizer), written one shard at a time (memory: one shard). Reused when `out` already holds one."""
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    names = _tensor_shapes(shape)
    weight_map: dict[str, str] = {}
    total = sum(math.prod(s) * 2 for _, s in names)
    n_shards = max(1, math.ceil(total / SHARD_BYTES))

    def flush(index: int) -> None:
        fname = "model.safetensors" if n_shards == 1 else f"model-{index + 1:05d}-of-{n_shards:05d}.safetensors"
        for k in shards[-1]:
            weight_map[k] = fname
        save_file(shards[-1], str(tmp / fname), metadata={"format": "pt"})
        shards[-1] = {}

    index = 0
    for name, s in names:
        nbytes = math.prod(s) * 2
        if size and size + nbytes > SHARD_BYTES and index < n_shards - 1:
            flush(index)
            index += 1
            size = 0
        if len(s) == 1:
            t = 1.0 + 0.1 * torch.randn(s, generator=g)
        else:
            t = 0.02 * torch.randn(s, generator=g)
        shards[-1][name] = t.to(torch.bfloat16)
        size += nbytes
    flush(index)
    if n_shards > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", **shape}
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(DEMO_MODEL / f, tmp / f)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def write_recipe(folder: Path, checkpoint: Path, method: str, name: str, calib_samples: int = 16,
                 calib_seq_len: int = 512, target: str = "onnxruntime") -> Path:
    """The build of the scale check: INT4 RTN, GPTQ or AWQ (g128, lm_head kept), INT8 (per channel, lm_head kept;
    SmoothQuant for int8-smoothquant), FP8 (per channel, lm_head and the embedding kept; activations dynamic, or
    static for fp8-static) or fp32, for ONNX Runtime CPU (lowered to ONNX and fused) or a torch target of TARGETS
    (model.pt2; the quantized Linears through lower_quant_torch). GPTQ, AWQ, int8-smoothquant and fp8-static
    calibrate on `calib_samples` windows of `calib_seq_len` tokens of the demo's calib.txt."""
    calibration = (f"calibration:\n  data: {CALIBRATION_DATA}\n  num_samples: {calib_samples}\n"
                   f"  seq_len: {calib_seq_len}\n") if method in CALIBRATED else ""
    backend, device, dtype = TARGETS[target]
    if backend == "torch" and method not in TORCH_METHODS:
        raise ValueError(f"method {method!r} has no torch target lowering (torch: {', '.join(TORCH_METHODS)})")
    if backend == "torch":  # the packed weights into the program; the CUDA-graph check (fake tensors)
        lowering = ("  - name: lower_quant_torch\n" if METHODS[method] else "") + "  - name: plan_cuda_graphs\n"
    else:  # ONNX, quantization lowered, fused; on CUDA the CUDA-graph check (its runs make zero weights)
        lowering = ("  - name: lower_onnx\n" + ("  - name: lower_quant\n" if METHODS[method] else "")
                    + "  - name: fuse\n" + ("  - name: plan_cuda_graphs\n" if device == "cuda" else ""))
    text = (f"name: {name}\nversion: 1.0.0\nsource:\n  checkpoint: {checkpoint}\n"
            f"target:\n  backend: {backend}\n  device: {device}\n  dtype: {dtype}\n"
            "passes:\n  - name: select_attention\n  - name: capture\n" + METHODS[method]
            + lowering + "  - name: package\n"
            "runtime:\n  kv_block_size: 16\n  num_kv_blocks: 256\n  max_num_seqs: 8\n"
            "  max_num_batched_tokens: 256\n  max_model_len: 1024\n"
            f"{calibration}output: {folder / 'artifacts'}\n")
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def run_measured(cmd: list[str], limit_bytes: int, env: dict[str, str] | None = None,
                 interval: float = 0.05) -> dict[str, Any]:
    """Run `cmd`, sampling its VmRSS; kill it past `limit_bytes`. Returns rc, peak (sampled max and the
    kernel's VmHWM at exit), wall time, whether it was killed, and the output's tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    peak = hwm = 0
    killed = False
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    while proc.poll() is None:
        rss = status_kb("VmRSS", proc.pid) * 1024
        hwm = max(hwm, status_kb("VmHWM", proc.pid) * 1024)
        peak = max(peak, rss)
        if rss > limit_bytes:
            proc.kill()
            killed = True
            break
        time.sleep(interval)
    rc = proc.wait()
    reader.join(timeout=10)
    return {"rc": rc, "peak_rss_bytes": max(peak, hwm), "sampled_rss_bytes": peak, "wall_s": time.perf_counter() - t0,
            "killed_at_limit": killed, "output_tail": "".join(out)[-3000:]}


def reference_steps(name: str, ckpt: Path, work: Path, peers_home: Path) -> list[tuple[str, list[str]]]:
    """The commands of a reference build (name in REFERENCES), each (label, argv), run in order."""
    py = str(peers_home / ".venv" / "bin" / "python")
    if name == "ort-genai":
        return [("builder int4", [py, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o",
                                  str(work / "ort-int4"), "-p", "int4", "-e", "cpu", "-c", str(work / "ort-cache")])]
    sources = sorted((peers_home / "build").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not sources:
        raise SystemExit(f"llama.cpp sources not found under {peers_home / 'build'}: run ../shared/peers/setup.sh")
    bf16, q4 = work / "model-bf16.gguf", work / "model-q4_0.gguf"
    return [("convert bf16", [py, str(PEERS / "to_gguf.py"), str(sources[-1]), str(ckpt), str(bf16), "--outtype",
                              "bf16"]),
            ("quantize q4_0", [py, "-c", QUANTIZE_GGUF, str(bf16), str(q4)])]


def measure_reference(name: str, shape: str, ckpt: Path, out: Path, peers_home: Path, limit_bytes: int) -> dict[str, Any]:
    """One reference row: each step measured by run_measured; peak = the largest, wall = the sum."""
    work = out / f"ref-{shape}-{name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    steps = []
    for label, cmd in reference_steps(name, ckpt, work, peers_home):
        r = run_measured(cmd, limit_bytes)
        steps.append({"step": label, **r})
        if r["rc"] != 0:
            break
    shutil.rmtree(work, ignore_errors=True)
    last = steps[-1]
    return {"shape": shape, "method": name, "estimate_bytes": None, "rc": last["rc"],
            "killed_at_limit": last["killed_at_limit"], "peak_rss_bytes": max(s["peak_rss_bytes"] for s in steps),
            "wall_s": sum(s["wall_s"] for s in steps), "output_tail": last["output_tail"],
            "steps": [{k: v for k, v in s.items() if k != "output_tail"} for s in steps]}


def _gb(n: float | None) -> str:
    return "—" if not n else f"{n / 1e9:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="100m", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--methods", default="rtn", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--targets", default="onnxruntime", help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bigmodels"), help="checkpoints and artifacts")
    ap.add_argument("--limit-gb", type=float, default=6.0, help="kill a build whose RSS passes this")
    ap.add_argument("--calib-samples", type=int, default=16, help="GPTQ, AWQ, fp8-static: calibration windows")
    ap.add_argument("--calib-seq-len", type=int, default=512, help="GPTQ, AWQ, fp8-static: tokens per calibration window")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "build_scale.json")
    ap.add_argument("--keep", action="store_true", help="keep the built artifacts (OUT/build-SHAPE-METHOD/artifacts)")
    ap.add_argument("--references", default="", help=f"comma-separated reference builders, of {', '.join(REFERENCES)}")
    ap.add_argument("--peers-home", type=Path, default=Path(os.environ.get("PEERS_HOME", PEERS)),
                    help="the peer benchmark's folder (its .venv and build/ from ../shared/peers/setup.sh)")
    ap.add_argument("--reference-limit-gb", type=float, default=20.0, help="kill a reference build past this")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    unknown = [m for m in a.methods.split(",") if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: {', '.join(unknown)} not of {', '.join(METHODS)}")
    unknown = [t for t in a.targets.split(",") if t not in TARGETS]
    if unknown:
        raise SystemExit(f"--targets: {', '.join(unknown)} not of {', '.join(TARGETS)}")
    rows = []
    for shape in a.shapes.split(","):
        ckpt = write_random_llama(a.out / f"llama-{shape}", shape)
        for target, method in itertools.product(a.targets.split(","), a.methods.split(",")):
            label = method if target == "onnxruntime" else f"{method}@{target}"
            work = a.out / f"build-{shape}-{label}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            recipe = write_recipe(work, ckpt, method, f"scale-{shape}-{label.replace('@', '-')}", a.calib_samples,
                                  a.calib_seq_len, target)
            dry = subprocess.run([sys.executable, "-m", "compiler.cli", "build", str(recipe), "--dry-run"],
                                 capture_output=True, text=True, env=env)
            estimate = None
            for line in dry.stdout.splitlines():
                if line.strip().startswith("build peak"):
                    estimate = float(line.split()[-2]) * {"GiB": 2**30, "MiB": 2**20}.get(line.split()[-1], 0)
            r = run_measured([sys.executable, "-m", "compiler.cli", "build", str(recipe), "--no-autotune",
                              "--no-progress", "--force"], int(a.limit_gb * 1e9), env=env)
            passes: dict[str, Any] = {}
            info = work / "artifacts" / f"scale-{shape}-{label.replace('@', '-')}" / "1.0.0" / "build.json"
            if info.is_file():
                passes = json.loads(info.read_text()).get("memory", {})
            row = {"shape": shape, "method": label, "target": "/".join(TARGETS[target]), "estimate_bytes": estimate, **r, "per_pass": passes,
                   **({"calibration_tokens": a.calib_samples * a.calib_seq_len} if method in CALIBRATED else {})}
            rows.append(row)
            status = "ok" if r["rc"] == 0 else ("killed at limit" if r["killed_at_limit"] else f"rc {r['rc']}")
            print(f"{shape:>5} {label:>4}: peak {_gb(r['peak_rss_bytes'])} GB, estimate {_gb(estimate)} GB, "
                  f"{r['wall_s']:.0f} s, {status}", flush=True)
            if r["rc"] != 0 and not r["killed_at_limit"]:
                print(r["output_tail"], file=sys.stderr)
            if not a.keep:
                shutil.rmtree(work / "artifacts", ignore_errors=True)
        for name in filter(None, a.references.split(",")):
            if name not in REFERENCES:
                raise SystemExit(f"--references: {name!r} is not one of {', '.join(REFERENCES)}")
            r = measure_reference(name, shape, ckpt, a.out, a.peers_home, int(a.reference_limit_gb * 1e9))
            rows.append(r)
            status = "ok" if r["rc"] == 0 else ("killed at limit" if r["killed_at_limit"] else f"rc {r['rc']}")
            print(f"{shape:>5} {name}: peak {_gb(r['peak_rss_bytes'])} GB, {r['wall_s']:.0f} s ("
                  + ", ".join(f"{s['step']} {_gb(s['peak_rss_bytes'])} GB {s['wall_s']:.0f} s" for s in r["steps"])
                  + f"), {status}", flush=True)
            if r["rc"] != 0 and not r["killed_at_limit"]:
                print(r["output_tail"], file=sys.stderr)
    print(f"\n{'shape':>6} {'method':>20} {'peak GB':>8} {'dry-run GB':>10} {'ratio':>6} {'wall s':>7}")
    for r in rows:
        ratio = f"{r['estimate_bytes'] / r['peak_rss_bytes']:.2f}" if r["estimate_bytes"] else "—"
        print(f"{r['shape']:>6} {r['method']:>20} {_gb(r['peak_rss_bytes']):>8} {_gb(r['estimate_bytes']):>10} "
              f"{ratio:>6} {r['wall_s']:>7.0f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                           "processor": platform.processor()},
                                  "rows": [{k: v for k, v in r.items() if k != "output_tail"} for r in rows]},
                                 indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
