#!/usr/bin/env bash
# The whole test suite on a GPU machine (the GPU image: torch, transformers 5.17, triton, no fla), twice side by side:
# without fla and with fla installed (issue 15). Needs the wheels carried in .whl/ (pytest-xdist, execnet, einops,
# fla-core, flash-linear-attention); fla goes into a --target folder put on PYTHONPATH for the second run only.
#
#   bash scripts/gpu_suite.sh OUT [workers per run, default 7]     (TESTS="tests/x.py ..." for a subset)
#
# Writes OUT/suite.md: each run's summary line and its failed tests with their first error line (the full logs stay
# in OUT/logs/, which a device call may not bring back: the summary is what to read).
set -u
out=${1:?usage: gpu_suite.sh OUT [workers]}
workers=${2:-7}
mkdir -p "$out/logs"
python=${PYTHON:-python3}
# one thread per worker: 2 runs x workers processes share the machine's cores (torch's default, one thread per core
# in every process, left run 34's suites 20x slower than CI and cut short by the limit)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$python" -m pip install -q --no-deps .whl/execnet-*.whl .whl/pytest_xdist-*.whl > /dev/null 2>&1
fla=$(mktemp -d)
"$python" -m pip install -q --no-deps --target "$fla" .whl/einops-*.whl .whl/fla_core-*.whl \
  .whl/flash_linear_attention-*.whl > /dev/null 2>&1
run() {  # name, extra PYTHONPATH
  # -v: a test's FAILED line is written when it fails, so a run cut short by the limit still names its failures
  PYTHONPATH="$2$PYTHONPATH" timeout "${LIMIT_S:-300}" "$python" -m pytest -v -n "$workers" --dist loadfile \
    -p no:cacheprovider -rf ${TESTS:-tests} > "$out/logs/$1.log" 2>&1
  echo "exit status $?" >> "$out/logs/$1.log"
}
run without_fla "" &
run with_fla "$fla:" &
wait
{
  echo "# The suite on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "- date: $(date -u +%FT%TZ)"
  echo "- torch $("$python" -c 'import torch; print(torch.__version__)'), transformers" \
       "$("$python" -c 'import transformers; print(transformers.__version__)'), triton" \
       "$("$python" -c 'import triton; print(triton.__version__)')," \
       "fla $(PYTHONPATH="$fla" "$python" -c 'import fla; print(fla.__version__)' 2>&1 | tail -1) (second run)"
  for name in without_fla with_fla; do
    echo
    echo "## $name"
    echo
    grep -E "(passed|failed|error).* in [0-9.]+s" "$out/logs/$name.log" | tail -n 1
    tail -n 1 "$out/logs/$name.log"
    echo "tests passed so far: $(grep -c " PASSED " "$out/logs/$name.log")"
    # the short summary (a run that finished: with the first error line), else the failures as they came
    if grep -qE "^FAILED|^ERROR" "$out/logs/$name.log"; then
      grep -E "^FAILED|^ERROR" "$out/logs/$name.log" | cut -c1-300 | head -n 60
    else
      grep -E " (FAILED|ERROR) " "$out/logs/$name.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | cut -c1-200 | head -n 60
    fi
  done
} > "$out/suite.md"
cat "$out/suite.md"
