"""Argument and gradient validation shared by every jaxcomp factory.

Every check raises ``ValueError`` naming the argument and the allowed range, and
returns the value normalised to a plain Python value (``float``, ``int``,
``bool``, ``str``, ``np.dtype``, ``tuple``), so numpy scalars and 0-d
numpy/JAX arrays of the right kind are accepted wherever a number is:

- ``check_real(name, value, low=None, high=None, *, low_open=False,
  high_open=False, allow_none=False, allow_traced=False) -> float``: a finite
  real number (never a ``bool``) in the interval; ``inf``/``nan`` rejected;
  a float32/bfloat16 value is read as the shortest decimal that rounds to it
  (``np.float32(0.1)`` is ``0.1``).
  With ``allow_traced=True`` a JAX array (concrete or traced, e.g. an
  ``optax.inject_hyperparams`` hyperparameter) is returned unchanged as a
  *dynamic* value (range-checked when concrete); use :func:`is_dynamic` to
  branch on it. Otherwise a traced value raises a ``ValueError`` telling the
  user to pass the argument in ``static_args`` of ``optax.inject_hyperparams``.
- ``check_int(name, value, low=None, high=None, *, allow_none=False,
  allow_traced=False) -> int``: an integer (Python, numpy, or 0-d integer
  array; not ``bool``, not ``2.0``) in ``[low, high]``.
- ``check_ratio(name, value) -> float``: ``check_real`` on ``(0, 1]``.
- ``check_ratios(name, value) -> tuple[float, ...]``: a sequence (not a
  scalar, not a string) of ratios in ``(0, 1]``.
- ``check_choice(name, value, choices) -> str``: one of ``choices``.
- ``check_bool(name, value) -> bool``: a Python or numpy bool.
- ``check_float_dtype(name, value) -> np.dtype``: a real floating dtype.
- ``check_groups(name, value)``: ``None``, a callable, a sequence of
  non-empty sequences of leaf-path strings (returned as a tuple of tuples; a
  path listed twice raises), or any other pytree of labels (returned as is,
  checked against the parameters later). JAX arrays raise.
- ``is_path_groups(value) -> bool``: whether ``value`` is the
  sequence-of-sequences-of-strings form of ``groups``.
- ``is_dynamic(value) -> bool``: a JAX array (a traced hyperparameter).
- ``check_gradient_leaves(tree, who)``: every leaf is a real floating array
  (bool, int and complex leaves raise, naming the leaf path).
- ``check_tree_like(tree, reference, who, *, shapes=True)``: ``tree`` has the
  structure (and leaf shapes) of ``reference`` (what ``init`` saw), else a
  ``ValueError`` naming the first differing leaf path.

Example:
  >>> import numpy as np
  >>> from jaxcomp._validation import check_int, check_ratio
  >>> check_ratio("ratio", np.float32(0.5)), check_int("levels", np.int64(4), 1)
  (0.5, 4)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_bool",
    "check_choice",
    "check_float_dtype",
    "check_gradient_leaves",
    "check_groups",
    "check_int",
    "check_ratio",
    "check_ratios",
    "check_real",
    "check_tree_like",
    "is_dynamic",
    "is_path_groups",
    "is_traced",
]


def is_traced(value: Any) -> bool:
    """Whether ``value`` is an abstract (traced) JAX value."""
    return isinstance(value, jax.core.Tracer)


def is_dynamic(value: Any) -> bool:
    """Whether ``value`` is a JAX array: a hyperparameter that may be traced."""
    return isinstance(value, jax.Array)


def _static_error(name: str) -> ValueError:
    return ValueError(
        f"{name} must be a static Python or numpy value (it fixes shapes, sizes or "
        f"the state's structure), got a traced JAX value; with optax.inject_hyperparams "
        f"pass {name!r} in static_args"
    )


def _interval(low, high, low_open, high_open) -> str:
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    left = "(" if (low_open or low is None) else "["
    right = ")" if (high_open or high is None) else "]"
    return f"{left}{lo}, {hi}{right}"


def _scalar_kind(value: Any) -> tuple[str, Any]:
    """(kind, value): kind in 'bool', 'int', 'float', 'array', 'traced', 'other'.

    Numpy scalars and 0-d numpy arrays become Python numbers; 0-d concrete JAX
    arrays are returned as 'array' (their Python value is read on demand).
    """
    if isinstance(value, (bool, np.bool_)):
        return "bool", value
    if is_traced(value):
        return "traced", value
    if isinstance(value, jax.Array):
        if value.ndim != 0:
            return "other", value
        if jnp.issubdtype(value.dtype, jnp.bool_):
            return "bool", value
        if jnp.issubdtype(value.dtype, jnp.integer):
            return "array-int", value
        if jnp.issubdtype(value.dtype, jnp.floating):
            return "array-float", value
        return "other", value
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            return "other", value
        value = value[()]
        if isinstance(value, np.bool_):
            return "bool", value
    if isinstance(value, numbers.Integral):
        return "int", int(value)
    if (
        isinstance(value, np.generic)
        and jnp.issubdtype(value.dtype, jnp.floating)
        and value.dtype.itemsize < 8
    ):
        # The shortest decimal that rounds to it: np.float32(0.1) means 0.1,
        # not 0.10000000149 (which would make k = ceil(ratio * n) one larger).
        return "float", float(str(value))
    if isinstance(value, numbers.Real):
        return "float", float(value)
    return "other", value


def _is_real_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    allow_traced: bool = False,
) -> Any:
    """A finite real number in the interval (see the module docstring)."""
    if value is None and allow_none:
        return None
    rng = _interval(low, high, low_open, high_open)
    what = f"{name} must be a finite real number in {rng}" + (" or None" if allow_none else "")
    kind, v = _scalar_kind(value)
    if kind == "traced":
        if not allow_traced:
            raise _static_error(name)
        if v.ndim != 0 or not _is_real_dtype(v.dtype):
            raise ValueError(f"{what}, got a traced {v.dtype}{list(v.shape)} value")
        return v
    if kind in ("array-int", "array-float"):
        x = _scalar_kind(np.asarray(v)[()])[1] if kind == "array-float" else float(v)
        if not allow_traced:
            v = x
    elif kind in ("int", "float"):
        x = v = float(v)
    else:
        raise ValueError(f"{what}, got {value!r}")
    ok = math.isfinite(x)
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        raise ValueError(f"{what}, got {value!r}")
    return v


def check_int(
    name: str,
    value: Any,
    low: int | None = None,
    high: int | None = None,
    *,
    allow_none: bool = False,
    allow_traced: bool = False,
) -> Any:
    """An integer in ``[low, high]`` (see the module docstring)."""
    if value is None and allow_none:
        return None
    rng = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
    what = f"{name} must be an integer in {rng}" + (" or None" if allow_none else "")
    kind, v = _scalar_kind(value)
    if kind == "traced":
        if not allow_traced:
            raise _static_error(name)
        if v.ndim != 0 or not jnp.issubdtype(v.dtype, jnp.integer):
            raise ValueError(f"{what}, got a traced {v.dtype}{list(v.shape)} value")
        return v
    if kind == "array-int":
        x = int(v)
        if not allow_traced:
            v = x
    elif kind == "int":
        x = v
    else:
        raise ValueError(f"{what}, got {value!r}")
    if (low is not None and x < low) or (high is not None and x > high):
        raise ValueError(f"{what}, got {value!r}")
    return v


def check_ratio(name: str, value: Any) -> float:
    """A density in ``(0, 1]``."""
    return check_real(name, value, 0.0, 1.0, low_open=True)


def check_ratios(name: str, value: Any) -> tuple[float, ...]:
    """A sequence of densities, each in ``(0, 1]``."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = list(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of ratios in (0, 1], got {value!r}")
    out = []
    for i, r in enumerate(value):
        try:
            out.append(check_ratio(f"{name}[{i}]", r))
        except ValueError:
            raise ValueError(
                f"{name} must be a sequence of ratios in (0, 1], got {value!r} (entry {i} is {r!r})"
            ) from None
    return tuple(out)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """One of ``choices`` (compared by equality; unhashable values rejected)."""
    choices = tuple(choices)
    if is_traced(value) or isinstance(value, (bool, np.bool_, jax.Array, np.ndarray)):
        ok = False
    else:
        try:
            ok = any(type(value) is type(c) and value == c for c in choices)
        except Exception:  # a value whose __eq__ misbehaves is not a choice
            ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """A Python or numpy bool (0-d bool arrays included)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if is_traced(value):
        raise _static_error(name)
    raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def check_float_dtype(name: str, value: Any) -> np.dtype:
    """A real floating-point dtype (``jnp.float32``, ``"bfloat16"``, ...)."""
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{name} must be a real floating-point dtype (float16, bfloat16, float32, "
            f"float64), got {value!r}"
        )
    return dtype


def is_path_groups(value: Any) -> bool:
    """Whether ``value`` is a list/tuple of lists/tuples of strings (leaf paths).

    The other forms of ``groups`` are a callable and a labels pytree; a labels
    pytree for list-structured parameters whose labels are strings would look
    the same, so such parameters take a callable returning their labels.
    """
    return isinstance(value, (list, tuple)) and all(
        isinstance(group, (list, tuple)) and all(isinstance(p, str) for p in group)
        for group in value
    )


def check_groups(name: str, value: Any) -> Any:
    """A ``groups`` spec of the sparsifiers (see :func:`jaxcomp.sparsify`).

    Only what can be checked without the parameters is checked here: leaf
    paths are matched against the parameters at ``init``.
    """
    if value is None or callable(value):
        return value
    if is_traced(value) or isinstance(value, (jax.Array, np.ndarray)):
        raise ValueError(
            f"{name} must be None, a sequence of sequences of leaf paths "
            "(jax.tree_util.keystr), a pytree of labels like the parameters, or a callable "
            f"params -> labels; got an array {value!r}"
        )
    if not is_path_groups(value):
        return value  # a labels pytree
    seen: dict[str, int] = {}
    for i, group in enumerate(value):
        if not group:
            raise ValueError(f"{name}[{i}] is empty: a group lists at least one leaf path")
        for path in group:
            if path in seen:
                raise ValueError(
                    f"{name}: leaf path {path!r} is listed in {name}[{seen[path]}] and "
                    f"{name}[{i}]; a leaf belongs to one group"
                )
            seen[path] = i
    return tuple(tuple(group) for group in value)


def _leaf_dtype(leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        dtype = jnp.asarray(leaf).dtype
    return np.dtype(dtype)


def check_gradient_leaves(tree: Any, who: str, what: str = "gradient") -> None:
    """Every leaf of ``tree`` is a real floating array, else a ``ValueError`` naming it.

    Complex leaves are rejected rather than silently losing their imaginary
    part in a real residual; bool/int leaves have no meaningful gradient
    (``jax.grad`` gives ``float0`` for them).
    """
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in path_leaves:
        dtype = _leaf_dtype(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(
                f"{who}: {what} leaf {jax.tree_util.keystr(path)} is complex ({dtype}); "
                "complex gradients are not supported (a real residual would drop the "
                "imaginary part): compress the real and imaginary parts as separate "
                "real leaves, or leave this leaf out (optax.masked)"
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{who}: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; "
                "only real floating-point leaves (float16, bfloat16, float32, float64) "
                "can be compressed: leave integer/bool leaves out (optax.masked)"
            )


def check_tree_like(tree: Any, reference: Any, who: str, *, shapes: bool = True) -> None:
    """``tree`` has ``reference``'s structure (and leaf shapes), else a ``ValueError``.

    ``reference`` is a state field laid out like the parameters ``init`` saw
    (the residual); the message names the first leaf path that differs.
    """
    ref_paths, ref_def = jax.tree_util.tree_flatten_with_path(reference)
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if treedef != ref_def:
        ref_keys = [jax.tree_util.keystr(p) for p, _ in ref_paths]
        keys = [jax.tree_util.keystr(p) for p, _ in paths]
        missing = [k for k in ref_keys if k not in set(keys)]
        extra = [k for k in keys if k not in set(ref_keys)]
        if extra:
            detail = f"leaf {extra[0]} was not in the tree init saw"
        elif missing:
            detail = f"leaf {missing[0]} that init saw is missing"
        else:
            detail = f"structure {treedef} differs from {ref_def}"
        raise ValueError(
            f"{who}: update got a gradient tree unlike the parameters given to init: "
            f"{detail} (init and update must see the same pytree structure)"
        )
    if shapes:
        for (path, leaf), (_, ref) in zip(paths, ref_paths, strict=True):
            if jnp.shape(leaf) != jnp.shape(ref):
                raise ValueError(
                    f"{who}: gradient leaf {jax.tree_util.keystr(path)} has shape "
                    f"{tuple(jnp.shape(leaf))} but init saw shape {tuple(jnp.shape(ref))}"
                )


def check_state_type(state: Any, types: Any, who: str) -> None:
    """``state`` is an instance of ``types`` (a class or tuple), else a ``ValueError``.

    A checkpoint restored without a target comes back as plain dicts and
    lists (orbax cannot know the NamedTuple types); without this check the
    first field read fails with ``'dict' object has no attribute ...``.
    """
    if isinstance(state, types):
        return
    types = types if isinstance(types, tuple) else (types,)
    names = " or ".join(t.__name__ for t in types)
    hint = "initialise it with this transform's init"
    if isinstance(state, (dict, list)):
        hint = (
            "a checkpoint restored without a target gives plain dicts and lists: restore "
            "with the abstract state as target (orbax: "
            "args.StandardRestore(jax.eval_shape(tx.init, params))), or use "
            "jaxcomp.elastic.restore"
        )
    raise ValueError(f"{who}: the state is a {type(state).__name__}, not a {names}; {hint}")
