"""Turn a checkpoint into one safetensors file of the whole model weights.

    python scripts/convert_checkpoint.py runs/x/checkpoints/ep0-ba1000 model.safetensors
    python scripts/convert_checkpoint.py runs/x/checkpoints model.safetensors   # its `latest`

Sharded checkpoints (strategy=fsdp: a `sharded/` folder of every rank's shards) are merged in
one process, no GPU or process group needed; a full checkpoint's model.safetensors is copied.
The output loads with `safetensors.torch.load_file`, into any strategy through `load_path`'s
model weights, or into the Hugging Face export.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint folder, or a save folder (its latest)")
    parser.add_argument("output", help="the safetensors file to write")
    args = parser.parse_args(argv)
    # Imported after parsing so --help answers without loading torch.
    from llmfoundry.checkpoint.sharded import convert_to_safetensors

    try:
        written = convert_to_safetensors(args.checkpoint, args.output)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
