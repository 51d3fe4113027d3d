"""A torchrun worker of tests/eval/test_harness.py: lm-eval in process on the local tasks with
the model split over the job's processes (tp or pp); the reporting rank writes the numbers.

    python scripts/torchrun.py --standalone --nproc_per_node=2 tests/eval/harness_mesh_worker.py \
        CHECKPOINT TASKS OUT tp=2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmfoundry.eval.forward import MeshForward
from llmfoundry.harness import FoundryLM
from tests.eval import lm_eval_parity as parity


def main(checkpoint: str, tasks: str, out: str, mesh: str) -> None:
    name, _, size = mesh.partition("=")
    lm = FoundryLM(checkpoint=checkpoint, max_seq_len=parity.MAX_LEN, **{name: size})
    assert isinstance(lm.forward, MeshForward)
    assert lm.forward.multiple == int(size) if name == "tp" else lm.forward.pipeline is not None
    results = parity.evaluate(lm, Path(tasks))
    if results is not None:  # lm-eval's reporting rank (LOCAL_RANK 0)
        Path(out).write_text(json.dumps(parity.numbers(results)))


if __name__ == "__main__":
    main(*sys.argv[1:])
