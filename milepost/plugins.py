"""Plug-ins by import path (`module.sub:function`), the one way user code enters a run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(path: str, setting: str) -> Callable[..., Any]:
    """The callable at `module.sub:attr`; a ValueError naming `setting` when it cannot be had."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"{setting}: {path!r} is not an import path 'module.sub:function'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{setting}: cannot import {path!r} (it could not be imported: {e})") from e
    if not callable(obj):
        raise ValueError(f"{setting}: {path!r} is not callable")
    return obj
