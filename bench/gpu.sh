#!/usr/bin/env bash
# One command for whoever gets a GPU: mpt-125m, mpt-350m and mpt-1b at sequence 2048 in bf16,
# every installed attention kernel, torch.compile off and on; tokens/s, MFU against the device's
# datasheet peak, peak memory. A few minutes on one H100/H200. Extra arguments go to the script,
# e.g. bench/gpu.sh --gpu-models mpt-1b --compile on --steps 20
# Then the tensor-parallel rows (bench/tensor_parallel.py: llama3-1b and mpt-1b, seq 2048,
# parallelism.tp=2 beside FSDP alone on the same two GPUs), when at least two GPUs are visible.
# Then the context-parallel rows (bench/context_parallel.py: mpt-125m in bf16 at 8k-32k tokens,
# cp=1 beside cp=2, and cp=4 with four GPUs: activation memory per GPU, step time, the ratios),
# when at least two GPUs are visible.
# Then the fp8 row: mpt-1b, sdpa, compile on, amp_bf16 beside amp_fp8 (torchao Float8Linear), on a
# GPU of compute capability 8.9+ (H100/H200/B200; it says so and skips otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" bench/train_throughput.py --gpu "$@"
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  for model in llama3-1b mpt-1b; do
    for tp in 1 2; do
      "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 \
        bench/tensor_parallel.py --model "$model" --tp "$tp"
    done
  done
else
  echo "tp row skipped: it needs at least 2 GPUs, $gpus visible"
fi
if [ "$gpus" -ge 2 ]; then
  cps="1 2"
  if [ "$gpus" -ge 4 ]; then cps="1 2 4"; fi
  # shellcheck disable=SC2086  # (cps: one argument per degree)
  "$PYTHON" bench/context_parallel.py --device cuda --cps $cps --model mpt-125m \
    --precision amp_bf16 --lengths 8192 16384 32768
else
  echo "cp rows skipped: they need at least 2 GPUs, $gpus visible"
fi
if "$PYTHON" -c "import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))"; then
  "$PYTHON" bench/train_throughput.py --gpu --gpu-models mpt-1b --attn-impls sdpa --compile on \
    --gpu-precisions amp_bf16 amp_fp8
else
  echo "fp8 row skipped: it needs a GPU of compute capability 8.9+"
fi
