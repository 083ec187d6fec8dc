"""The environment switches' one parsing rule: a switch is off when its variable is set to ``0``, ``false``,
``off`` or ``no`` (case and surrounding spaces ignored); unset or any other value leaves it on. Imports
nothing from the package, so every layer can use it."""

from __future__ import annotations

import os

OFF_VALUES = frozenset({"0", "false", "off", "no"})


def switched_off(name: str) -> bool:
    """True when the environment variable ``name`` turns its switch off (read now, on every call)."""
    value = os.environ.get(name)
    return value is not None and value.strip().lower() in OFF_VALUES
