"""Evaluation of trained models on in-context-learning tasks (icl.py)."""

from llmfoundry.eval.icl import KINDS, Task, evaluate_tasks, load_task, summary_table

__all__ = ["KINDS", "Task", "evaluate_tasks", "load_task", "summary_table"]
