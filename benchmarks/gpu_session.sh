#!/usr/bin/env bash
# Everything the open CUDA work needs from a GPU, in one device call (a session is lent 15 minutes of
# GPU time, machine start included, so this is prepared to run once, unattended, within a total budget:
# 540 s unless MEMEST_GPU_BUDGET_S says otherwise; a device call may run 600 s).
#
#   bash benchmarks/gpu_session.sh "$OUT"        # on the GPU machine, from the repository root
#
# The GPU machine has its own python3, torch and lightning (not this project's pins) and no registry:
# the project runs from the source tree (PYTHONPATH), nothing is installed. Parts run in priority
# order, each under its own time limit, each writing its own files into the output folder, so a part
# that fails or runs out of time costs only itself:
#
#   environment.txt           GPU, driver, torch / CUDA / cuDNN, package versions, import check
#   cuda_tests.txt            the tests that only run with a GPU (real fake-CUDA simulation, CUDA measure,
#                               a ResNet step capped at its smallest-workspace figure: cuDNN fallback)
#   cuda_paths.jsonl          CUDA's code paths in the what-if against the GPU: dropout's bool mask, the
#                               SDP backend under the user's flags (benchmarks/cuda_paths_check.py)
#   cuda_validation.jsonl     issue 6: estimate vs max_memory_allocated/reserved per case, the CPU-only
#   cuda_validation.md          what-if, the calibrated estimate (cuDNN workspaces measured, smallest-
#                               workspace peak), device bytes vs mem_get_info (rows stream in as cases finish;
#                               `python benchmarks/cuda_validation.py --from-rows F` redraws the tables)
#   workspaces.tar.gz         per-op CUDA kernel excess (cuDNN/cuBLAS workspaces, reserve spaces) for
#                               a few models: benchmarks/find_kernel_workspaces.py --device cuda --json
#   batch_size_vs_finder.md   issue 5: FitBatchSize against Lightning's BatchSizeFinder
#   session.log               everything printed, with the time each part took
set -uo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the usage, and the comment above
    printf 'usage: bash benchmarks/gpu_session.sh OUTPUT_FOLDER\n\n'
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
    exit 0
fi
out="${1:-${OUT:-}}"
if [ -z "$out" ]; then
    echo "usage: bash benchmarks/gpu_session.sh OUTPUT_FOLDER" >&2
    exit 2
fi
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PY="${PYTHON:-python3}" out
deadline=$(($(date +%s) + ${MEMEST_GPU_BUDGET_S:-540}))
exec > >(tee -a "$out/session.log") 2>&1

part() {  # part NAME SECONDS COMMAND...: run COMMAND (or a function) under min(SECONDS, time left)
    local name="$1" limit="$2" start rc left
    shift 2
    start=$(date +%s)
    left=$((deadline - start))
    if [ "$left" -lt "$limit" ]; then limit="$left"; fi
    if [ "$limit" -lt 15 ]; then
        echo "=== $name: skipped, the session's budget is spent"
        return
    fi
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout -k 10 "$limit" bash -c '"$@"' _ "$@"
    rc=$?
    echo "=== $name: exit $rc after $(($(date +%s) - start))s"
}

environment() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("lightning", "torchvision", "tensorboard", "matplotlib", "pytest"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
import lightning_memest
print("lightning_memest imports from", lightning_memest.__file__)
EOF
}

workspaces() {
    local dir
    dir="$(mktemp -d)"
    # name batch optimizer precision: convolutions (cuDNN), attention (SDPA backends), RNN reserve,
    # batch-norm reserve, GEMMs under bf16 autocast.
    while read -r model batch optimizer precision; do
        echo "--- $model b$batch $optimizer $precision"
        # The whole table goes to a file (piping into head would cut the script off before it writes
        # its JSON); its head is shown here.
        timeout -k 5 45 "$PY" benchmarks/find_kernel_workspaces.py "$model" --device cuda \
            --batch-size "$batch" --optimizer "$optimizer" --precision "$precision" \
            --json "$dir/${model}_${precision}.json" >"$dir/${model}_${precision}.txt" 2>&1
        head -40 "$dir/${model}_${precision}.txt"
    done <<'EOF'
resnet50 4 sgd 32-true
vit_b_16 4 adam 32-true
lstm 8 adam 32-true
gpt 8 adamw bf16-mixed
mobilenet_v2 4 adamw 32-true
resnet18 4 sgd bf16-mixed
EOF
    tar -czf "$out/workspaces.tar.gz" -C "$dir" .
}

export -f environment workspaces
part environment 30 environment | tee "$out/environment.txt"
part cuda_tests 90 "$PY" -m pytest -q -p no:cacheprovider tests -k cuda | tee "$out/cuda_tests.txt"
part cuda_paths 90 "$PY" benchmarks/cuda_paths_check.py --json | tee "$out/cuda_paths.jsonl"
part cuda_validation 240 "$PY" benchmarks/cuda_validation.py --rows "$out/cuda_validation.jsonl"
if [ -s "$out/cuda_validation.jsonl" ]; then
    "$PY" benchmarks/cuda_validation.py --from-rows "$out/cuda_validation.jsonl" >"$out/cuda_validation.md"
fi
part workspaces 150 workspaces
part batch_size_vs_finder 120 "$PY" benchmarks/batch_size_vs_finder.py --models resnet50 \
    | tee "$out/batch_size_vs_finder.md"
echo "=== done $(date -u +%H:%M:%S)"
