#!/usr/bin/env bash
# The README's "Where it stands" batch figures in one GPU call, every file packed into one tar (a device call returns
# at most 8 files): HybridSpec (int8 and bf16 drafter heads) and vanilla DFlash against AR at batch 1 under the low /
# medium / high profiles with max-shape rounds (the default), the int8-head method again with exact-length rounds,
# and batch 4 medium both ways. Limits per step keep the whole under a 10-minute call (≈ 9 minutes on an H100 with a
# cold Triton cache, where the batch-4 steps may still be cut: run them again in a call of their own with STEPS); a
# step cut by its limit still leaves its log in the tar.
#
#   bash benchmarks/headline.sh OUT_DIR [TAG]          # writes OUT_DIR/TAG.tar.gz (TAG: headline), run from the repo
#   STEPS=b4_max,b4_exact bash benchmarks/headline.sh OUT_DIR TAG   # only those steps (a second call for batch 4)
#   MODEL=tiny bash benchmarks/headline.sh /tmp/h     # the harness on a CPU (tiny random model: timings say nothing)
#
# The tar holds batch_b1_TAG_max / _exact and batch_b4_TAG_max / _exact .{md,json,png,log}; each md says its GPU,
# versions, date and command. Random bf16 weights; acceptance replayed from the declared profiles (benchmarks/profiles).
set -o pipefail
out=${1:?usage: bash benchmarks/headline.sh OUT_DIR [TAG]}
tag=${2:-headline}
python=${PYTHON:-python3}
work=$(mktemp -d)
mkdir -p "$out"
extra=()
[ "${MODEL:-}" = tiny ] && extra=(--model tiny --tokens 8 --context 12)

steps=",${STEPS:-b1_max,b1_exact,b4_max,b4_exact},"
for key in ${STEPS//,/ }; do
  case ",b1_max,b1_exact,b4_max,b4_exact," in
    *",$key,"*) ;;
    *) echo "STEPS: unknown step '$key' (b1_max, b1_exact, b4_max, b4_exact)" >&2; exit 2 ;;
  esac
done

step() {  # step KEY LIMIT_S BATCH_ARGS...: one batch.py run (if STEPS names KEY), output in its NAME.log, tar after it
  local key=$1 limit=$2 start=$SECONDS
  local name="batch_${key%%_*}_${tag}_${key#*_}"
  shift 2
  [[ $steps == *",$key,"* ]] || return 0
  timeout "$limit" "$python" benchmarks/batch.py "$@" "${extra[@]}" --name "$work/$name" > "$work/$name.log" 2>&1
  echo "$name: rc $? after $((SECONDS - start)) s"
  tail -n 3 "$work/$name.log"
  tar -czf "$out/$tag.tar.gz" -C "$work" .
}

b1=(--batches 1 --profiles low,medium,high --repeats 3)
b4=(--batches 4 --profiles medium --repeats 1)
# run 168 (H100, cold Triton cache): 141 / 162 s for the batch-1 steps, and the batch-4 ones cut at 80 / 110 s
# (warm, runs 170-171: 52 / 77 s of batch.py's own elapsed time); run 172 (cold): 143 / 145 s, then batch 4 max 95 s
# of batch.py plus ≈ 15 s of imports (cut at 110 s after its files were written) and exact cut at 126 s
step b1_max 170 "${b1[@]}" --verify-shape max --methods ar,hybridspec+int8-head,hybridspec,dflash
step b1_exact 180 "${b1[@]}" --verify-shape exact --methods ar,hybridspec+int8-head
step b4_max 125 "${b4[@]}" --verify-shape max --methods ar,hybridspec+int8-head
step b4_exact 150 "${b4[@]}" --verify-shape exact --methods ar,hybridspec+int8-head
