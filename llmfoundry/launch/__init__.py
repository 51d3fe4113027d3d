"""Launching runs: the job file, GPUs laid out on nodes, local / Slurm / Kubernetes backends,
and monitoring runs from their status files."""

from llmfoundry.launch.job import Job, load_job
from llmfoundry.launch.layout import Layout, plan

__all__ = ["Job", "Layout", "load_job", "plan"]
