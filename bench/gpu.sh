#!/usr/bin/env bash
# One command for whoever gets a GPU: mpt-125m, mpt-350m and mpt-1b at sequence 2048 in bf16,
# every installed attention kernel, torch.compile off and on; tokens/s, MFU against the device's
# datasheet peak, peak memory. A few minutes on one H100/H200. Extra arguments go to the script,
# e.g. bench/gpu.sh --gpu-models mpt-1b --compile on --steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/train_throughput.py --gpu "$@"
