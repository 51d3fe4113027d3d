#!/usr/bin/env bash
# One command for whoever gets a GPU: mpt-125m, mpt-350m and mpt-1b at sequence 2048 in bf16,
# every installed attention kernel, torch.compile off and on; tokens/s, MFU against the device's
# datasheet peak, peak memory. A few minutes on one H100/H200. Extra arguments go to the script,
# e.g. bench/gpu.sh --gpu-models mpt-1b --compile on --steps 20
# Then the tensor-parallel row (bench/tensor_parallel.py: llama3-1b, seq 2048, strategy.tp=2
# beside FSDP alone on the same two GPUs), when at least two GPUs are visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" bench/train_throughput.py --gpu "$@"
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  for tp in 1 2; do
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 \
      bench/tensor_parallel.py --tp "$tp"
  done
else
  echo "tp row skipped: it needs at least 2 GPUs, $gpus visible"
fi
