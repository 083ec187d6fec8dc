"""The environment switches' one parsing rule: a switch is off when its variable is set to ``0``, ``false``,
``off`` or ``no``, on when unset, empty or set to ``1``, ``true``, ``on`` or ``yes`` (case and surrounding spaces
ignored); any other value is an error, so that a mistyped value is never taken for one of them. Imports nothing
from the package, so every layer can use it."""

from __future__ import annotations

import os

OFF_VALUES = frozenset({"0", "false", "off", "no"})
ON_VALUES = frozenset({"", "1", "true", "on", "yes"})


def switched_off(name: str) -> bool:
    """True when the environment variable ``name`` turns its switch off (read now, on every call).

    Raises:
        ValueError: the variable holds a value that is neither an off nor an on value (the message names it).
    """
    value = os.environ.get(name)
    if value is None:
        return False
    word = value.strip().lower()
    if word in OFF_VALUES:
        return True
    if word in ON_VALUES:
        return False
    raise ValueError(f"{name}={value!r}: a switch takes 0 / false / off / no to turn it off, or 1 / true / on / yes "
                     "(or nothing) to leave it on")
