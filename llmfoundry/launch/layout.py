"""GPUs to nodes x processes per node: the one place a job's compute becomes torchrun's shape.

A job asks for GPUs in total, as on MosaicML's platform; the nodes of a cluster have a fixed
number each. Requests that fill whole nodes (24 on nodes of 8: 3 x 8), or fit in one node (4 on
a node of 8: 1 x 4), are laid out; anything else (12 on nodes of 8 would leave 4 GPUs of a node
idle or need uneven nodes, which torchrun does not support) is refused with what would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfoundry.config import ConfigError
from llmfoundry.launch.job import Compute


@dataclass(frozen=True)
class Layout:
    nodes: int
    procs_per_node: int
    gpus_per_node: int  # 0: CPU processes

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def plan(compute: Compute, default_gpus_per_node: int, max_nodes: int | None = None) -> Layout:
    """Lay out `compute` on nodes of `compute.gpus_per_node` (else the cluster default) GPUs.

    `max_nodes` bounds the node count (1 for the local backend). Raises ConfigError naming the
    field to change.
    """
    if compute.gpus == 0:
        nodes = compute.nodes or 1
        layout = Layout(nodes, compute.procs_per_node, 0)
    else:
        per_node = compute.gpus_per_node or default_gpus_per_node
        if compute.gpus <= per_node:
            layout = Layout(1, compute.gpus, compute.gpus)
        elif compute.gpus % per_node:
            below = compute.gpus - compute.gpus % per_node
            raise ConfigError(
                "compute.gpus",
                f"{compute.gpus} GPUs do not fill whole nodes of {per_node}; ask for "
                f"{below} or {below + per_node} (whole nodes), at most {per_node} (one node), or "
                "set compute.gpus_per_node to what the nodes have",
            )
        else:
            nodes = compute.gpus // per_node
            layout = Layout(nodes, per_node, per_node)
        if compute.nodes is not None and compute.nodes != layout.nodes:
            raise ConfigError(
                "compute.nodes",
                f"{compute.nodes} nodes, but {compute.gpus} GPUs on nodes of {per_node} make "
                f"{layout.nodes}; set compute.nodes=null or change compute.gpus",
            )
    if max_nodes is not None and layout.nodes > max_nodes:
        raise ConfigError(
            "compute.gpus" if compute.gpus else "compute.nodes",
            f"needs {layout.nodes} nodes but this backend runs on {max_nodes}; use the slurm "
            "or kubernetes backend for multi-node runs",
        )
    return layout
