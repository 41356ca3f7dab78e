"""Observability: metrics sinks (metrics.py), the step progress bar (progress.py), plots (report.py)."""
