# Shared by demo.sh and test.sh: make_venv DIR TRANSFORMERS_VERSION EXTRAS — a venv with the CPU torch wheel.
make_venv() {
  local dir=$1 transformers=$2 extras=$3
  [ -x "$dir/bin/python" ] || "${PYTHON:-python3}" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  # torch first, from the CPU wheel: a plain `pip install torch` would fetch a multi-GB CUDA build
  "$dir/bin/python" -m pip install -q -c constraints/ci.txt torch
  "$dir/bin/python" -m pip install -q -c constraints/ci.txt "transformers==$transformers" -e ".[$extras]"
}
TRANSFORMERS_NEWEST=5.24.0
TRANSFORMERS_GPU_IMAGE=5.17.0
