#!/usr/bin/env bash
# Memory check of the C engine core (runtime/core/_core.c, _scheduler.c, _sampler.c).
#
#   scripts/memcheck.sh [extra pytest arguments]
#
# Builds runtime.core._core with AddressSanitizer and UndefinedBehaviorSanitizer into a temporary
# folder (a copy of runtime/ and of the core tests; the installed extension is never touched),
# preloads libasan into Python with PYTHONMALLOC=malloc (so Python objects and PyMem buffers are
# checked too) and runs the C-core tests listed in TESTS below there: test_core_c.py (C vs. twin
# streams, scatter, copies, constructor and error paths), test_core_reference.py and
# test_prefix_cache.py (both impls), test_sampling.py (C vs. twin sampling). Exits non-zero on any
# sanitizer report (any error aborts the run), a test failure, no test run, or a missing libasan.
# tests/test_memcheck.py runs this script in the default test suite (CI). Leaks of the core's own allocations are checked by
# tests/test_core_c.py::test_no_memory_growth_over_many_schedulers_and_samples (tracemalloc);
# LeakSanitizer is off because CPython itself keeps memory until exit.
set -euo pipefail

# The tests run under the sanitizers (files in tests/), and the helpers they import. A new test of
# C code goes here.
TESTS=(test_core_c.py test_core_reference.py test_prefix_cache.py test_sampling.py)
HELPERS=(test_core_fixtures.py)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
CC=${CC:-gcc}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/memcheck.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
LIBASAN=$("$CC" -print-file-name=libasan.so)
if [[ ! -e "$LIBASAN" ]]; then
    echo "memcheck: $CC has no libasan.so (install the compiler's sanitizer runtime, e.g. libasan8)" >&2
    exit 2
fi

cp -r "$ROOT/runtime" "$TMP/runtime"
find "$TMP/runtime" -name '_core*.so' -delete
find "$TMP/runtime" -name '__pycache__' -prune -exec rm -rf {} +
mkdir "$TMP/tests"
for f in "${TESTS[@]}" "${HELPERS[@]}"; do
    cp "$ROOT/tests/$f" "$TMP/tests/"
done
printf '[pytest]\naddopts = -p no:cacheprovider\n' > "$TMP/pytest.ini"

echo "memcheck: building the extension with -fsanitize=address,undefined"
"$CC" -shared -fPIC -std=c11 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -fno-trapping-math \
    -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror \
    -I"$INC" "$ROOT/runtime/core/_core.c" "$ROOT/runtime/core/_scheduler.c" "$ROOT/runtime/core/_sampler.c" \
    -o "$TMP/runtime/core/_core$SUFFIX"

cd "$TMP"
export PYTHONPATH="$TMP" PYTHONMALLOC=malloc PYTHONDONTWRITEBYTECODE=1
# Reports go to files (pytest captures stderr, and an aborted run would lose them).
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:log_path=$TMP/sanitizer"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$TMP/sanitizer"
where=$(LD_PRELOAD="$LIBASAN" "$PY" -c 'import runtime.core._core as c; print(c.__file__)')
if [[ "$where" != "$TMP"/* ]]; then
    echo "memcheck: imported $where instead of the sanitized build" >&2
    exit 2
fi
echo "memcheck: running the core tests on $where"
set +e
LD_PRELOAD="$LIBASAN" "$PY" -m pytest -q "${TESTS[@]/#/tests/}" "$@" 2>&1 | tee "$TMP/log.txt"
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
if grep -qE "[0-9]+ skipped" "$TMP/log.txt" || ! grep -qE "^[0-9]+ passed" "$TMP/log.txt"; then
    echo "memcheck: FAILED (tests were skipped or none passed)" >&2
    exit 1
fi
echo "memcheck: OK (no AddressSanitizer/UBSan errors; tests passed)"
