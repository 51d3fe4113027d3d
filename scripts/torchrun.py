"""torchrun, with the same arguments, that ends a problem you can fix in its one line.

    python scripts/torchrun.py --nproc_per_node=2 scripts/train.py strategy=ddp ...

When every process exits 2 (a config or launch problem, printed once by rank 0) it adds nothing
and exits 2; any other failure shows torchrun's whole report (llmfoundry/launch/torchrun.py).
"""

import sys

from llmfoundry.launch.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
