#!/usr/bin/env bash
# Memory check of the C code: the engine core (runtime/core/*.c: _core.c, _block_pool.c, _prefix_cache.c,
# _scheduler.c, _sampler.c) and the ONNX Runtime custom-op library (runtime/kernels/: ort_ops.c and one op_*.c
# file per op). Both source lists are read from their Extensions in setup.py, so the two builds never differ.
#
#   scripts/memcheck.sh [extra pytest arguments]
#
# Builds runtime.core._core with AddressSanitizer and UndefinedBehaviorSanitizer into a temporary
# folder (a copy of runtime/ and of the core tests; the installed extension is never touched),
# preloads libasan into Python with PYTHONMALLOC=malloc (so Python objects and PyMem buffers are
# checked too) and runs the C-core tests listed in TESTS below there: test_core_c.py (C vs. twin
# streams, scatter, copies, constructor and error paths), test_core_reference.py and
# test_prefix_cache.py (both impls), test_sampling.py (C vs. twin sampling), and the kernel library
# built the same way from the sources setup.py lists for runtime.kernels._paged_attention_cpu (read from
# setup.py, so a new op file is checked without editing this script), with every per-CPU code path (isa_*.c:
# each op's avx512 / avx2 / baseline loops, chosen by plain function pointers, no ifunc resolvers), loaded by
# ONNX Runtime in test_paged_cpu_kernel.py (hypothesis steps against the reference attention, in-place pool
# writes, refused steps) and test_matmul_bf16_kernel.py, each path this CPU runs in turn. Exits non-zero on any sanitizer report (any
# error aborts the run), a test failure, no test run, a skip other than a code path this CPU lacks, or a
# missing libasan.
# tests/test_memcheck.py runs this script in the default test suite (CI). Leaks of the core's own allocations are checked by
# tests/test_core_c.py::test_no_memory_growth_over_many_schedulers_and_samples (tracemalloc);
# LeakSanitizer is off because CPython itself keeps memory until exit.
set -euo pipefail

# The tests run under the sanitizers (files in tests/), and the helpers they import. A new test of
# C code goes here.
TESTS=(test_core_c.py test_core_reference.py test_prefix_cache.py test_sampling.py test_paged_cpu_kernel.py test_kv_events.py
       test_matmul_bf16_kernel.py)
HELPERS=(test_core_fixtures.py cpu_paths.py onnx_model.py)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
CC=${CC:-gcc}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/memcheck.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
# sources_of NAME: the C files setup.py builds the extension NAME from, one per line
sources_of() {
    local found
    found=$("$PY" - "$ROOT/setup.py" "$1" <<'EOF_PY'
import ast
import sys

for node in ast.walk(ast.parse(open(sys.argv[1], encoding="utf-8").read())):
    if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension" and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == sys.argv[2]):
        for kw in node.keywords:
            if kw.arg == "sources":
                print("\n".join(ast.literal_eval(kw.value)))
EOF_PY
)
    printf '%s\n' "$found"
}
mapfile -t CORE_SOURCES < <(sources_of runtime.core._core)
mapfile -t KERNEL_SOURCES < <(sources_of runtime.kernels._paged_attention_cpu)
if [[ -z "${CORE_SOURCES[*]}" || -z "${KERNEL_SOURCES[*]}" ]]; then
    echo "memcheck: setup.py lists no sources for runtime.core._core or runtime.kernels._paged_attention_cpu" >&2
    exit 2
fi
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
LIBASAN=$("$CC" -print-file-name=libasan.so)
if [[ ! -e "$LIBASAN" ]]; then
    echo "memcheck: $CC has no libasan.so (install the compiler's sanitizer runtime, e.g. libasan8)" >&2
    exit 2
fi
# ONNX Runtime throws C++ exceptions (a refused step): libstdc++ must be loaded when the sanitizer
# runtime starts, or its __cxa_throw interceptor finds nothing to forward to
LIBSTDCXX=$("$CC" -print-file-name=libstdc++.so)
PRELOAD="$LIBASAN $(readlink -f "$LIBSTDCXX")"

cp -r "$ROOT/runtime" "$TMP/runtime"
cp -r "$ROOT/compiler" "$TMP/compiler"  # pure Python: test_matmul_bf16_kernel.py packs weights with it
find "$TMP/runtime" -name '_core*.so' -delete
find "$TMP/runtime" -name '_paged_attention_cpu*.so' -delete
find "$TMP/runtime" -name '__pycache__' -prune -exec rm -rf {} +
mkdir "$TMP/tests"
for f in "${TESTS[@]}" "${HELPERS[@]}"; do
    cp "$ROOT/tests/$f" "$TMP/tests/"
done
printf '[pytest]\naddopts = -p no:cacheprovider\n' > "$TMP/pytest.ini"

echo "memcheck: building the extension with -fsanitize=address,undefined"
"$CC" -shared -fPIC -std=c11 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -fno-trapping-math \
    -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror \
    -I"$INC" "${CORE_SOURCES[@]/#/$ROOT/}" \
    -o "$TMP/runtime/core/_core$SUFFIX"
# the kernel with all of its ops and code paths
"$CC" -shared -fPIC -std=gnu11 -O1 -g -fno-omit-frame-pointer -fno-trapping-math \
    -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra -Wno-psabi -Werror \
    "${KERNEL_SOURCES[@]/#/$ROOT/}" -o "$TMP/runtime/kernels/_paged_attention_cpu$SUFFIX"

cd "$TMP"
export PYTHONPATH="$TMP" PYTHONMALLOC=malloc PYTHONDONTWRITEBYTECODE=1
# Reports go to files (pytest captures stderr, and an aborted run would lose them).
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:log_path=$TMP/sanitizer"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$TMP/sanitizer"
where=$(LD_PRELOAD="$PRELOAD" "$PY" -c 'import runtime.core._core as c; print(c.__file__)')
if [[ "$where" != "$TMP"/* ]]; then
    echo "memcheck: imported $where instead of the sanitized build" >&2
    exit 2
fi
kernel=$(LD_PRELOAD="$PRELOAD" "$PY" -c 'from runtime.kernels.paged_attention_cpu import library_path; print(library_path())')
if [[ "$kernel" != "$TMP"/* ]]; then
    echo "memcheck: found the kernel library $kernel instead of the sanitized build" >&2
    exit 2
fi
echo "memcheck: running the tests on $where and $kernel"
set +e
LD_PRELOAD="$PRELOAD" "$PY" -m pytest -q -rs "${TESTS[@]/#/tests/}" "$@" 2>&1 | tee "$TMP/log.txt"
status=${PIPESTATUS[0]}
set -e
if compgen -G "$TMP/sanitizer*" > /dev/null; then
    cat "$TMP"/sanitizer* >&2
    echo "memcheck: FAILED (sanitizer report above)" >&2
    exit 1
fi
if grep -qE "ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$TMP/log.txt"; then
    echo "memcheck: FAILED (sanitizer report above)" >&2
    exit 1
fi
if [[ $status -ne 0 ]]; then
    echo "memcheck: FAILED (pytest exit status $status)" >&2
    exit "$status"
fi
# the only skips allowed: a code path this CPU cannot run (tests/cpu_paths.py names the missing features)
if grep -E "^SKIPPED" "$TMP/log.txt" | grep -vq "this CPU lacks" || ! grep -qE "^[0-9]+ passed" "$TMP/log.txt"; then
    echo "memcheck: FAILED (tests were skipped for a reason other than the CPU, or none passed)" >&2
    exit 1
fi
echo "memcheck: OK (no AddressSanitizer/UBSan errors; tests passed)"
