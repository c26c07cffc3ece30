#!/usr/bin/env bash
# The int8 greedy head's decision in one GPU call (HybridSpecConfig.greedy_head, resident.INT8_GREEDY_HEAD), every
# file packed into one tar (a device call returns at most 8 files): its CUDA tests, the head alone
# (greedy_head.py: bf16 head + argmax against the int8 path at 1 / 4 / 16 rows), the AR step with and without it in
# situ (kernel_costs.py; one pass and two, the plain step first and last for the noise), then batch 1 with and
# without it for AR and HybridSpec (int8 drafter head) under the low / medium / high profiles. Limits per step keep
# the whole under a 10-minute call; a step cut by its limit still leaves its log in the tar.
#
#   bash benchmarks/greedy_head_ab.sh OUT_DIR [TAG]        # writes OUT_DIR/TAG.tar.gz (TAG: greedy_head_ab)
#   MODEL=tiny bash benchmarks/greedy_head_ab.sh /tmp/g     # the harness on a CPU (tiny shapes: timings say nothing)
#
# Decision rule (benchmarks/results/gpu_rounds_runs.md, written before the first run): INT8_GREEDY_HEAD on by default
# if the AR step gains beyond the spread of the plain rows and AR and HybridSpec both gain at batch 1 in every
# profile, the tests passing. Random bf16 weights; acceptance replayed from the declared profiles.
set -o pipefail
out=${1:?usage: bash benchmarks/greedy_head_ab.sh OUT_DIR [TAG]}
tag=${2:-greedy_head_ab}
python=${PYTHON:-python3}
work=$(mktemp -d)
mkdir -p "$out"
head=() costs=() batch=()
if [ "${MODEL:-}" = tiny ]; then
  head=(--vocab 2048 --hidden 128 --rows 1,3)
  costs=(--model tiny --replays 2)
  batch=(--model tiny --tokens 8 --context 12)
fi

step() {  # step NAME LIMIT_S COMMAND...: its output in NAME.log, the tar refreshed after it
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "$name: rc $? after $((SECONDS - start)) s"
  tail -n 3 "$work/$name.log"
  tar -czf "$out/$tag.tar.gz" -C "$work" .
}

step "cuda_tests_$tag" 140 "$python" -m pytest tests/test_head_argmax_cuda.py -q -p no:logging
step "greedy_head_$tag" 80 "$python" benchmarks/greedy_head.py "${head[@]}" --name "$work/greedy_head_$tag"
step "kernel_costs_$tag" 150 "$python" benchmarks/kernel_costs.py "${costs[@]}" --name "$work/kernel_costs_$tag" \
  --variants plain,+int8-greedy-head,+int8-greedy-head-greedy-two-pass,plain,+int8-greedy-head
step "batch_b1_$tag" 190 "$python" benchmarks/batch.py "${batch[@]}" --name "$work/batch_b1_$tag" --repeats 2 \
  --batches 1 --profiles low,medium,high \
  --methods ar,ar+int8-greedy-head,hybridspec+int8-head,hybridspec+int8-head+int8-greedy-head
