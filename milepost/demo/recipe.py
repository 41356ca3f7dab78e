"""The demo base model's recipe: its shape, the two supervised phases and their targets.

Kept free of torch so `python -m milepost.demo.prepare` can set OpenMP's wait policy before torch
loads (milepost/launch/process.py says why). `milepost.demo.base_model` runs the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost.demo.task import TEACHER_ACCURACY


class DemoModelError(RuntimeError):
    """The supervised pass did not reach the intended regime within its step caps."""


@dataclass(frozen=True)
class DemoModelRecipe:
    """Shape of the model and settings of its supervised pass (every field feeds the result)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    initializer_range: float = 0.02
    batch_size: int = 128
    # Constant after warmup, never annealed to ~0: a model left in a sharp minimum by a decayed
    # lr lost reward under the first RL updates.
    lr: float = 3e-3
    warmup_steps: int = 50
    # Drills end at the first check where held-out sampled accuracy (no estimates yet, so this is
    # "right when computing") reaches drill_target; max_drill_steps caps them.
    drill_target: float = 0.97
    max_drill_steps: int = 4000
    # The tutor phase restarts the warmup at a lower lr (a sudden switch to 60% estimates at the
    # drills' lr cost a third of the adding skill), runs at least min_tutor_steps, then ends at the
    # first check inside the band with computing accuracy kept; max_tutor_steps caps it.
    tutor_lr: float = 5e-4
    tutor_warmup_steps: int = 25
    min_tutor_steps: int = 100
    max_tutor_steps: int = 1000
    teacher_accuracy: float = TEACHER_ACCURACY
    exact_band: tuple[float, float] = (0.2, 0.45)
    min_computing_accuracy: float = 0.9
    check_every: int = 25  # steps between held-out checks (they decide when a phase ends)
    seed: int = 0
    eval_problems: int = 512  # held-out problems for the checks and demo_model.json
