"""Peak resident memory of two training steps of one model config (any family), printed as JSON.

Run in a fresh process with MALLOC_MMAP_THRESHOLD_ set low, so that every large tensor is its own
mapping, returned to the system when freed (resident memory then follows the live tensors). A
warm-up step of a tiny model of the same kind first loads every kernel and library page; the
peak (VmHWM) is then reset and measured over the steps of the real model.
"""

import gc
import json
import sys

import torch

from llmfoundry.models.families import FAMILIES, build_model
from llmfoundry.optim import DecoupledAdamW, build_param_groups


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def train(cfg, batch: int, seq: int, steps: int, precision: str) -> None:
    model = build_model(cfg)
    opt = DecoupledAdamW(build_param_groups(model), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
            loss = model.loss(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    precision, batch, seq = spec.pop("precision"), spec.pop("batch"), spec.pop("seq")
    config = FAMILIES[spec.pop("family", "mpt")].config_class
    torch.set_num_threads(1)
    tiny = {**spec, "d_model": spec["n_heads"] * 8, "n_layers": 1, "vocab_size": 64}
    train(config(**tiny), 1, seq, 1, precision)
    gc.collect()
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    train(config(**spec), batch, seq, 2, precision)
    print(json.dumps({"peak": status("VmHWM:") - base}))


if __name__ == "__main__":
    main()
