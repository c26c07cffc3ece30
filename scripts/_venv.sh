# Shared by demo.sh and test.sh: make_venv DIR TRANSFORMERS_VERSION EXTRAS — a venv with torch, then the package.
#
# Where torch comes from (a plain `pip install torch` on Linux fetches the multi-GB CUDA build):
#   TORCH_INDEX_URL unset (default): a torch wheel that pip's configuration offers without any index (its
#       find-links, e.g. a local wheel folder: this is how CI gets its CPU wheel), else the CPU wheel from
#       https://download.pytorch.org/whl/cpu.
#   TORCH_INDEX_URL=URL: torch from that index only, e.g. https://download.pytorch.org/whl/cu128 for CUDA 12.8.
#   TORCH_INDEX_URL=pypi: whatever plain `pip install torch` picks (pip's configured indexes).
# The torch version is pinned by constraints/ci.txt. A venv that already has that version keeps it.
TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

make_venv() {
  local dir=$1 transformers=$2 extras=$3
  local pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
  if [ ! -x "$dir/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$dir"
    "${pip[@]}" --upgrade pip
  fi
  local pinned
  pinned=$(sed -n 's/^torch==//p' constraints/ci.txt)
  if ! "$dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$pinned')" 2>/dev/null; then
    case "${TORCH_INDEX_URL:-}" in
      "")  # a local wheel first (no network; its dependencies then come from pip's indexes), else the CPU index
        if "${pip[@]}" --no-index --no-deps -c constraints/ci.txt torch 2>/dev/null; then
          "${pip[@]}" -c constraints/ci.txt torch
        else
          "${pip[@]}" --index-url "$TORCH_CPU_INDEX_URL" -c constraints/ci.txt torch
        fi ;;
      pypi) "${pip[@]}" -c constraints/ci.txt torch ;;
      *) "${pip[@]}" --index-url "$TORCH_INDEX_URL" -c constraints/ci.txt torch ;;
    esac
  fi
  # -qq: errors only; setuptools prints an information-only note ("Editable installation ... folders with the
  # same name") for every editable install with a package_dir mapping (patches/ -> hybridspec_hf.patches)
  "${pip[@]}" -q -c constraints/ci.txt "transformers==$transformers" -e ".[$extras]"
}
TRANSFORMERS_NEWEST=5.25.0
TRANSFORMERS_GPU_IMAGE=5.17.0
