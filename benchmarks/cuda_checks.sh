#!/usr/bin/env bash
# The checks that need a GPU, in one short run: the CUDA tests (GPipe on CUDA streams, two
# partitions on cuda:0; copy streams), the profiler on CUDA (events, allocator peak, cold
# caches), the planner's accuracy with the GPipe executor on the GPU, and the GPU's catalog
# entry fitted to profiles measured on it (with the units whose counted bytes differ there).
#
# Usage: bash benchmarks/cuda_checks.sh [OUT_DIR]   (default: benchmarks/results/cuda)
# Writes cuda_tests.log, profile_mlp_cuda.json, accuracy_cuda.{md,json}, fit_cuda0.{md,json}
# and gpu.txt there. The interpreter is $PYTHON, else python3, else python.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/cuda}"
mkdir -p "$out"
python="${PYTHON:-$(command -v python3 || command -v python)}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$python" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" >> "$out/gpu.txt"

# Every test that needs CUDA (the executor's and the profiler's), and the rest of theirs
# on the same build.
"$python" -m pytest -q -rs tests/gpipe tests/profiler \
    2>&1 | tee "$out/cuda_tests.log"

"$python" -m autopipe profile examples/mlp.py --device cuda:0 -o "$out/profile_mlp_cuda.json" \
    2>&1 | tail -n 3
"$python" -m autopipe plan --profile "$out/profile_mlp_cuda.json" --stages 2 2>&1 | tee "$out/plan_mlp_cuda.txt"

"$python" -m benchmarks.accuracy.ranked_plans --device cuda:0 --repeats 10 --top 4 2>&1 | tail -n 40
cp benchmarks/results/accuracy_cuda.* "$out/" 2>/dev/null || true

# The GPU's catalog entry fitted to its measured profiles; counted vs measured bytes there.
"$python" -m benchmarks.planning.fit_device --device cuda:0 --out "$out" 2>&1 | tail -n 12
