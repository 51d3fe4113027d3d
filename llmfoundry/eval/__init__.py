"""Evaluation of trained models on in-context-learning tasks: ours (icl.py) and llm-foundry's
icl_tasks (foundry_tasks.py), scored through scoring.py."""

from llmfoundry.eval.foundry_tasks import FoundryTask, load_icl_tasks, load_tasks
from llmfoundry.eval.icl import KINDS, Task, evaluate_tasks, load_task

__all__ = [
    "KINDS",
    "FoundryTask",
    "Task",
    "evaluate_tasks",
    "load_icl_tasks",
    "load_task",
    "load_tasks",
]
