"""The sweep's scorers' first home, kept so that ``from rlmerge.scorers import TaskScorer`` still works: they live in
``rlmerge.scoring`` (one module per kind of scorer)."""

from __future__ import annotations

from .scoring import ACCURACY_LIKE, TaskScorer, load_model, primary_metric

__all__ = ["ACCURACY_LIKE", "TaskScorer", "load_model", "primary_metric"]
