"""What every settings table shares: no unknown keys, no NaN or infinity, and the constants the
tables and their validators use."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

MIB = 1 << 20
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
BUILTIN_REWARDS = ("exact_match", "math", "math_verify")  # math_verify: milepost[math]
BUILTIN_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
RESOLVED_NAME = "config.resolved.toml"


class Table(BaseModel):
    # No NaN or infinity in any float setting (`--lr inf` would train the weights into NaN).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
