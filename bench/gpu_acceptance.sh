#!/usr/bin/env bash
# The GPU acceptance run (bench/gpu_acceptance.py: its phases, timeouts and JSON lines) on one
# GPU machine without network. The packages such a machine lacks (hydra-core, omegaconf, antlr4,
# fastapi, starlette, uvicorn, pydantic, torchao, zstandard: `make gpu-wheels` puts them in .whl/)
# are installed from .whl/ (or $WHEELS) into a folder of their own on PYTHONPATH; this checkout
# is imported from where it is, so nothing needs `pip install -e`. Arguments go to the script:
#   bench/gpu_acceptance.sh --out results/            # every phase, about 5 minutes on an H200
#   bench/gpu_acceptance.sh --only fsdp_resume,serve  # some phases (and what they read)
#   bench/gpu_acceptance.sh --device cpu              # the dry run (CI): tiny shapes, no GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/llmfoundry-gpu-wheels"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
exec "$PYTHON" bench/gpu_acceptance.py "$@"
