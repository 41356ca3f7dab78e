"""Evaluation: scores a policy version on held-out prompts and proves which version it measured."""
