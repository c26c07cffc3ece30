#!/usr/bin/env bash
# Several GPUs (issue 14), on a machine with 2 GPUs, from the repository root; each part fits one 10-minute call:
#
#   bash scripts/gpu_multigpu.sh OUT tests          # TP exactness over NCCL + device placement tests (~3-5 min)
#   bash scripts/gpu_multigpu.sh OUT correctness    # Qwen3.5-122B-A10B shape, every strategy vs generate() (~5-7 min)
#   bash scripts/gpu_multigpu.sh OUT timing         # the same shape: AR / DFlash / HybridSpec per profile (~8-9 min)
#
# Extra arguments go to benchmarks/multigpu.py (e.g. --layers 40, --cuda-graphs uncaptured). Everything it writes
# lands in OUT: PART.log (the whole output), nvidia-smi before and after, the benchmark's multigpu_*.json/.md, the
# tests' per-rank reports (OUT/pytest/...). The part is ended after LIMIT_S seconds (default 570), so that a hung
# collective cannot outlive the call.
set -u
out=${1:?usage: gpu_multigpu.sh OUT tests|correctness|timing [benchmark options]}
part=${2:?usage: gpu_multigpu.sh OUT tests|correctness|timing [benchmark options]}
shift 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python}
limit=${LIMIT_S:-570}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export HYBRIDSPEC_CACHE="$out/cache"
bench=("$python" -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/multigpu.py --out "$out"
       --budget-s $((limit - 90)))
case "$part" in
  tests) command=("$python" -m pytest tests/test_tensor_parallel.py tests/test_devices_cuda.py -q -rA
                  --basetemp="$out/pytest") ;;
  correctness) command=("${bench[@]}" --modes correctness "$@") ;;
  timing) command=("${bench[@]}" --modes timing "$@") ;;
  *) echo "unknown part '$part': tests, correctness or timing" >&2; exit 2 ;;
esac
nvidia-smi > "$out/nvidia-smi-$part-before.txt" 2>&1 || true
echo "$(date -u +%FT%TZ) ${command[*]}" | tee "$out/$part.log"
# timeout signals the part's whole process group: SIGTERM first (torchrun then ends its workers), SIGKILL 30 s later
timeout --kill-after=30 "$limit" "${command[@]}" >> "$out/$part.log" 2>&1
code=$?
[ "$code" = 124 ] && echo "gpu_multigpu.sh: the $limit s limit ended the part" >> "$out/$part.log"
nvidia-smi > "$out/nvidia-smi-$part-after.txt" 2>&1 || true
echo "$(date -u +%FT%TZ) exit status $code" >> "$out/$part.log"
tail -n 60 "$out/$part.log"
exit "$code"
