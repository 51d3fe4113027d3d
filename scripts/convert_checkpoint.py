"""Turn a checkpoint into one safetensors file of the whole model weights.

    python scripts/convert_checkpoint.py runs/x/checkpoints/ep0-ba1000 model.safetensors
    python scripts/convert_checkpoint.py runs/x/checkpoints model.safetensors   # its `latest`
    python scripts/convert_checkpoint.py s3://bucket/x/checkpoints model.safetensors \
        --storage '{options: {endpoint_url: http://localhost:9000}}'

Sharded checkpoints (strategy=fsdp: a `sharded/` folder of every rank's shards) are merged in
one process, no GPU or process group needed, read in place from a local folder or an object store
(--storage: the training config's storage: block); a full checkpoint's model.safetensors is
copied.
The output loads with `safetensors.torch.load_file`, into any strategy through `load_path`'s
model weights, or into the Hugging Face export.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmfoundry.utils.cli import add_script_arguments, script_errors


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint folder, or a save folder (its latest)")
    parser.add_argument("output", help="the safetensors file to write")
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    # Imported after parsing so --help answers without loading torch.
    from llmfoundry.checkpoint.sharded import convert_to_safetensors

    with script_errors(args):
        written = convert_to_safetensors(args.checkpoint, args.output)
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
