"""Compressor presets as data, and the one builder that makes a compressor of a preset.

A preset names a jaxcomp factory and its keyword arguments::

    {"compressor": "ldte_bs", "kwargs": {"ratio": 1e-3, "defer_residual": True}}

(:func:`spec` writes one: ``spec("ldte_bs", ratio=1e-3, defer_residual=True)``).
The programs' tables map a row's name to such a preset (``demo.COMPRESSORS``,
``bench_model.COMPRESSORS``, ``bench_exchange.QUANTIZERS``, ...); every one
of them is built by :func:`build`, ``getattr(jaxcomp, compressor)(axis_name=...,
**kwargs)``, so a table is plain data a JSON file can record, not code. A dtype
is written by name (``"bfloat16"``), which the factories accept.
"""

from __future__ import annotations

from typing import Any

import jaxcomp

__all__ = ["build", "spec"]


def spec(compressor: str, **kwargs: Any) -> dict[str, Any]:
    """The preset ``{"compressor": compressor, "kwargs": kwargs}`` (a public jaxcomp factory)."""
    if not callable(getattr(jaxcomp, compressor, None)):
        raise ValueError(f"no jaxcomp factory {compressor!r}")
    return {"compressor": compressor, "kwargs": kwargs}


def build(preset: dict[str, Any], axis_name: str | None = None, **overrides: Any):
    """The compressor of ``preset``: ``getattr(jaxcomp, compressor)(axis_name=..., **kwargs)``.

    Args:
      preset: ``{"compressor": name, "kwargs": {...}}`` (see :func:`spec`).
      axis_name: the mesh axis it exchanges over (None: one device, no exchange).
      **overrides: keyword arguments set by the caller's loop, over the preset's
        (``reuse_period=s``, ``groups=plan.groups``, ...).
    """
    factory = getattr(jaxcomp, preset["compressor"])
    return factory(axis_name=axis_name, **{**preset["kwargs"], **overrides})
