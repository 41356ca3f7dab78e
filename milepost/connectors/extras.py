"""Optional packages of the connectors: imported on first use, with an error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A connector's package is not installed; the message names the pip extra that installs it."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError telling the user `pip install 'milepost[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs the {module!r} package, which is not installed ({e}); "
            f"install it with: pip install 'milepost[{extra}]'") from e
