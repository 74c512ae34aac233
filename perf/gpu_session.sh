#!/usr/bin/env bash
# One prepared run of the Triton backend's GPU checks, for a short loan of a GPU machine (about 10 minutes of run
# time in one call). Every stage has its own time limit and writes its log under $OUT, so a stage that hangs or runs
# long costs only its own share and what ran before it still comes back.
#
#   bash perf/gpu_session.sh            # on the GPU machine, from the repository root; logs in $OUT (or ./gpu-out)
#
# Stages, most wanted first:
#   1. perf/triton_gpu.py --targets-only: the issue-3 targets, the tuning sweeps (sparse attention's key ranges,
#      the indexer's tokens a program), the indexer's top-k share with each select, the GEMM tile shapes the
#      autotuner kept.                                                                          -> triton_targets.txt
#   2. the Triton unit tests and the parity suite on the triton backend, natively on the GPU (Hadamard at the
#      real widths, the split attention, the top-k kernel, the grouped GEMMs among them).      -> triton_parity.txt
#   3. with the time left, perf/triton_gpu.py's every-op table (it repeats the targets first). -> triton_all.txt
# The machine reaches no package registry: glm5-hal is installed from this tree without dependencies, over the
# torch / triton / numpy / pytest the machine has (PyTorch 2.11 and Triton 3.6 on the H200 lent so far).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
BUDGET_S="${BUDGET_S:-560}"  # the whole script's share of the call's limit (600 s at most)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET_S - SECONDS)); }
stage() {  # stage <name> <seconds at most> <command...>: runs it under `timeout`, logs to $OUT/<name>.txt
  local name=$1 limit=$2
  shift 2
  local allowed=$(( limit < $(left) ? limit : $(left) ))
  if (( allowed < 20 )); then
    echo "== $name: skipped, ${allowed}s left" | tee -a "$OUT/summary.txt"
    return
  fi
  local start=$SECONDS
  timeout --kill-after=10 "$allowed" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $((SECONDS - start))s (limit ${allowed}s)" | tee -a "$OUT/summary.txt"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
  lscpu | grep -m1 'Model name'
} >"$OUT/summary.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/summary.txt" 2>&1 ||
  echo "pip install -e . failed (the checks run from the tree anyway)" >>"$OUT/summary.txt"

stage triton_targets 300 python3 -m perf.triton_gpu --targets-only
stage triton_parity 180 env GLM5_HAL_BACKEND=triton python3 -m pytest -q -rf -p no:cacheprovider \
  parity_tests/test_triton_attention_unit.py parity_tests/test_triton_topk_unit.py \
  parity_tests/test_triton_moe_unit.py parity_tests/test_parity.py
stage triton_all 600 python3 -m perf.triton_gpu
cat "$OUT/summary.txt"
