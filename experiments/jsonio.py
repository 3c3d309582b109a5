"""Strict JSON for the result files the experiments write.

Python's ``json`` writes a non-finite float as ``NaN`` or ``Infinity``, which
is not JSON: ``jq``, JavaScript and other strict parsers reject the whole
file. A diverged run (a NaN loss) or an empty measurement would do that to
a results file, so every program under ``experiments/`` writes through
:func:`dumps` / :func:`dump`, which write such a value as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dump", "dumps", "strict"]


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of :func:`strict` ``(obj)``; raises on anything else not JSON."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def dump(obj: Any, f, **kwargs) -> None:
    """``json.dump`` of :func:`strict` ``(obj)`` into the open text file ``f``."""
    json.dump(strict(obj), f, allow_nan=False, **kwargs)
