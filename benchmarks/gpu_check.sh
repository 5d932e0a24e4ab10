#!/usr/bin/env bash
# kvpatch on a CUDA GPU, in one run of at most 12 minutes:
#   1. the test suite with CUDA as torch's default device (pytest --device cuda), bf16 and fp16
#      included where tests take a dtype; the files that exercise no device are left to the CPU;
#   2. benchmarks/gpu_check.py: decode per token, memory and KVzip's prefill cost of a
#      Llama-3-8B-shaped model (4 layers, bf16) at 8k, 32k and 128k tokens;
#   3. benchmarks/gpu_capacity.py: the largest batch of 32k-token rows that fits on the card on
#      the whole 32-layer model, with the full cache and compressed ones, and its throughput.
# Writes tests.log, tests.xml, bench.log, results.md, results.json, capacity.log, capacity.md and
# capacity.json to OUT (default gpu_check_out). Needs PyTorch, transformers and wrapt only
# (pytest-xdist used if present).
#
#   benchmarks/gpu_check.sh [--dry-run] [OUT] [-- GPU_CHECK_PY_ARGS...]
#
# --dry-run: the same steps on the CPU with tiny shapes and one test file (tests/test_gpu_check.py
# runs it).
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
out=gpu_check_out
options=()
while (($#)); do
    arg=$1
    shift
    case $arg in
        --) options=("$@"); break ;;
        --dry-run) dry_run=1 ;;
        -h | --help) sed -n "2,16p" "$0"; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (valid: --dry-run, -h)" >&2; exit 2 ;;
        *) out=$arg ;;
    esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
commit=${KVPATCH_COMMIT:-$(git describe --always --dirty 2>/dev/null || echo unknown)}

# files whose tests exercise no device (code shape, command lines, examples, the demo model,
# multi-process CPU runs): the CPU suite covers them
cpu_only=(test_structure test_entry_points test_cli test_eval test_examples test_demo
    test_distributed test_real_model test_gpu_check)
if ((dry_run)); then
    device=cpu tests=(tests/test_fake_keys.py) test_limit=120 bench_limit=120 capacity_limit=120
    options+=(--dry-run)
    capacity_options=(--dry-run)
else
    device=cuda tests=(tests) test_limit=240 bench_limit=300 capacity_limit=180
    capacity_options=()
    for name in "${cpu_only[@]}"; do tests+=(--ignore "tests/$name.py"); done
    if "$python" -c "import xdist" 2>/dev/null; then tests+=(-n 12); fi
    if "$python" -c "import pytest_timeout" 2>/dev/null; then tests+=(--timeout 60); fi
fi

status=0
echo "== tests on $device" | tee "$out/tests.log"
timeout "$test_limit" "$python" -m pytest "${tests[@]}" --device "$device" -q -p no:cacheprovider \
    --junitxml "$out/tests.xml" >>"$out/tests.log" 2>&1 || status=1
tail -n 30 "$out/tests.log"

echo "== benchmark on $device"
timeout "$bench_limit" "$python" -m benchmarks.gpu_check --device "$device" --out "$out" \
    --commit "$commit" "${options[@]}" 2>&1 | tee "$out/bench.log" || status=1

echo "== capacity on $device"
timeout "$capacity_limit" "$python" -m benchmarks.gpu_capacity --device "$device" --out "$out" \
    "${capacity_options[@]}" 2>&1 | tee "$out/capacity.log" || status=1
exit $status
