#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU (under 10 minutes on one GPU, each stage time-limited):
#   1. the GPU tests (tests/gpu: torch/cuda, onnxruntime/cuda, tensorrt; each skips with its reason),
#   2. bench/gpu.py: the demo built for each GPU target whose packages are here, greedy tokens against
#      the CPU artifact, decode tokens/s at batch 1/8/32 with and without CUDA graphs, TTFT at 512 tokens;
#      one table at the end (and gpu.json, rewritten after every row),
#   3. the CPU kernels on this machine's CPU (a server CPU, typically with AVX-512: the paths a 2-core CI
#      machine may lack): tests/test_cpu_isa.py, test_paged_cpu_kernel.py, test_matmul_bf16_kernel.py on every
#      code path this CPU runs, then bench/isa.py's per-path table (ops only),
#   4. bench/gpu.py --shape SCALE_SHAPE (default 1b): the torch/cuda target on a random Llama of a real shape in
#      bfloat16 (build, load, device memory, logits against transformers, decode, TTFT).
# Each stage has its own time limit (GPU_TESTS_S, GPU_BENCH_S, CPU_TESTS_S, CPU_BENCH_S, SCALE_S seconds; all
# together under 10 minutes), so one stage that hangs or runs long still leaves the others their turn.
# Packages this project needs that the machine lacks can come as wheels in .whl/ (tests/gpu/wheels.sh
# downloads them on a machine with network access); they are installed into /tmp/site first. Where the C
# extensions cannot be compiled there (no Python headers), extensions built elsewhere for that Python and
# placed in the tree (*.cpython-3XY-*.so) are used.
# OUT_DIR receives 8 files (four logs, the C extension build's log, gpu.json, isa.json, gpu-SHAPE.json); artifacts stay
# in WORK_DIR.
# Usage: tests/gpu/run.sh [OUT_DIR]      (OUT_DIR defaults to $OUT, else /tmp/optimize-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-/tmp/optimize-gpu}}
WORK_DIR=${WORK_DIR:-/tmp/optimize-gpu-work}
mkdir -p "$OUT_DIR" "$WORK_DIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
start=$(date +%s)
stamp() { echo "== $1 (at $(( $(date +%s) - start )) s)"; }

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the C extensions in place (no download: no build isolation, no dependencies)
if ! $PY setup.py -q build_ext --inplace > "$OUT_DIR/build_ext.log" 2>&1; then
  suffix=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  if [[ -f runtime/core/_core$suffix && -f runtime/kernels/_paged_attention_cpu$suffix && -f compiler/quant/_int4$suffix ]]; then
    echo "C extensions could not be built here (build_ext.log); using the ones in the tree ($suffix)"
  else
    echo "C extension build failed, and no prebuilt *$suffix in the tree:"; tail -20 "$OUT_DIR/build_ext.log"; exit 1
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

stamp "environment"
$PY -c "import json; from runtime.gpu import describe; print(json.dumps(describe(), indent=1))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
lscpu 2>/dev/null | grep -E "^(Model name|CPU\(s\))" || true
grep -o -w -E "avx2|fma|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|amx_bf16|amx_int8" /proc/cpuinfo 2>/dev/null \
  | sort -u | tr '\n' ' '; echo

stamp "tests/gpu"
timeout "${GPU_TESTS_S:-170}" $PY -m pytest -v -rs -p no:cacheprovider -n 4 --durations=15 tests/gpu 2>&1 | tee "$OUT_DIR/pytest.log"
tests_rc=${PIPESTATUS[0]}

stamp "bench/gpu.py"
timeout "${GPU_BENCH_S:-180}" $PY bench/gpu.py --out "$WORK_DIR/bench" --rounds 3 --steps 30 2>&1 \
  | tee "$OUT_DIR/bench_gpu.log" | grep -v "^{"
bench_rc=${PIPESTATUS[0]}
cp "$WORK_DIR/bench/gpu.json" "$OUT_DIR/gpu.json" 2>/dev/null || true

stamp "CPU kernel code paths (this machine's CPU)"
timeout "${CPU_TESTS_S:-45}" $PY -m pytest -q -rs -p no:cacheprovider -n 4 tests/test_cpu_isa.py \
  tests/test_paged_cpu_kernel.py tests/test_matmul_bf16_kernel.py -k "not retune and not another_code_path" 2>&1 \
  | tee "$OUT_DIR/cpu_kernels.log" | tail -15
cpu_rc=${PIPESTATUS[0]}
timeout "${CPU_BENCH_S:-40}" $PY bench/isa.py --no-demo --rounds 3 --out "$WORK_DIR/isa" 2>&1 \
  | tee -a "$OUT_DIR/cpu_kernels.log" | tail -25
cp "$WORK_DIR/isa/isa.json" "$OUT_DIR/isa.json" 2>/dev/null || true

shape=${SCALE_SHAPE:-1b}
stamp "bench/gpu.py --shape $shape"
timeout "${SCALE_S:-150}" $PY bench/gpu.py --shape "$shape" --out "$WORK_DIR/scale" --dtypes bfloat16 --rounds 2 --steps 20 2>&1 \
  | tee "$OUT_DIR/bench_scale.log" | grep -v "^{"
scale_rc=${PIPESTATUS[0]}
cp "$WORK_DIR/scale/gpu-$shape.json" "$OUT_DIR/" 2>/dev/null || true

stamp "done (tests rc=$tests_rc, bench rc=$bench_rc, cpu kernels rc=$cpu_rc, scale rc=$scale_rc)"
[[ $cpu_rc -ne 0 ]] && exit "$cpu_rc"
[[ $tests_rc -ne 0 && $tests_rc -ne 5 ]] && exit "$tests_rc"
[[ $bench_rc -ne 0 ]] && exit "$bench_rc"
exit "$scale_rc"
