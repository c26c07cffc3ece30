#!/usr/bin/env bash
# Fresh machine → the whole CPU test suite (with the README quickstart, the examples and the notebooks). Installs into .venv (newest pinned transformers) and .venv-tf517
# (transformers 5.17.0, the GPU image's version), runs every test in the first and the generate/exactness/drafter
# tests again in the second. Triton kernels run under TRITON_INTERPRET=1 (set by their tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
make_venv .venv "$TRANSFORMERS_NEWEST" test,train,notebooks
make_venv .venv-tf517 "$TRANSFORMERS_GPU_IMAGE" test,train
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
.venv/bin/python -m pytest tests -q "$@"
.venv-tf517/bin/python -m pytest -q "$@" tests/test_exactness.py tests/test_generate_semantics.py \
  tests/test_errors_and_integration.py tests/test_drafter.py tests/test_tensor_parallel.py tests/test_resident.py \
  tests/test_patches.py tests/test_exception_safety.py tests/test_properties.py tests/test_devices.py \
  tests/test_batched.py tests/test_attention_triton.py tests/test_gemv_triton.py tests/test_moe_block_triton.py \
  tests/test_routing_and_syncs.py tests/test_rope_table.py tests/test_context_lookup.py
