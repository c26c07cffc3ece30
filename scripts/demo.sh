#!/usr/bin/env bash
# Fresh machine → the main job: AR vs HybridSpec side by side on CPU with the shipped tiny pair.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
make_venv .venv "$TRANSFORMERS_NEWEST" train
HF_HUB_OFFLINE=1 .venv/bin/hybridspec demo "$@"
