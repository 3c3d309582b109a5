"""The package's shape: one home per concept, kept that way.

* No module of ``jaxcomp`` reaches into another module's private names
  (``from m import _x`` or ``m._x``): a name another module needs is public in
  its own module, even if not in ``__all__``. Modules whose own name starts
  with ``_`` (``jaxcomp._validation``, ``jaxcomp._vma``, ...) are the
  package's shared internals, as optax's ``_src`` is: any module may import
  them, and their names inside are public to the package.
* The common options (``axis_name``, ``min_dense_size``, ``residual_dtype``,
  ``nonfinite``, ``seed``) are checked in one place
  (:func:`jaxcomp.transforms.base.check_common_options`): every compressor
  rejects the same bad value with the same message.
* The named sparsifiers forward every common keyword of ``sparsify`` by name,
  with ``sparsify``'s default.
* Imports run down the layers only (:data:`LAYERS`), and none is circular.
"""

import ast
import importlib
import inspect
import pathlib

import jax.numpy as jnp
import pytest

import jaxcomp
from jaxcomp.transforms import sparsifiers
from jaxcomp.transforms.base import NONFINITE_POLICIES

PACKAGE = pathlib.Path(jaxcomp.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_uses():
    """``(user module, "owner.name")`` for every private name used across modules."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        user = _module_name(path)
        tree = ast.parse(path.read_text())
        bound = {}  # local alias -> jaxcomp module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                owner = _resolve(user, node, path.name == "__init__.py")
                for alias in node.names:
                    full = f"{owner}.{alias.name}"
                    if full in modules:  # a module imported from its package
                        bound[alias.asname or alias.name] = full
                    elif owner in modules and owner != user and _private(alias.name):
                        out.append((user, full))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and bound[node.value.id] != user
                and _private(node.attr)
            ):
                out.append((user, f"{bound[node.value.id]}.{node.attr}"))
    return sorted(set(out))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_used_across_modules():
    uses = _private_uses()
    assert not uses, "private names used across modules (make them public in their own):\n" + (
        "\n".join(f"  {user}: {name}" for user, name in uses)
    )


def test_the_scan_sees_a_private_use(tmp_path, monkeypatch):
    """The check above can fail: a planted ``from jaxcomp.x import _y`` is found."""
    fake = tmp_path / "jaxcomp"
    (fake / "sub").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "a.py").write_text("_secret = 1\n")
    (fake / "b.py").write_text(
        "from jaxcomp.sub.a import _secret\nfrom jaxcomp.sub import a\nx = a._secret\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _private_uses() == [("jaxcomp.b", "jaxcomp.sub.a._secret")]


# Each compressor factory with its required arguments.
FACTORIES = {
    "sparsify": lambda **kw: jaxcomp.sparsify("top_k", 0.1, **kw),
    "top_k": lambda **kw: jaxcomp.top_k(0.1, **kw),
    "ldte_bs": lambda **kw: jaxcomp.ldte_bs(0.1, **kw),
    "dgc": lambda **kw: jaxcomp.dgc(0.1, **kw),
    "qsgd": lambda **kw: jaxcomp.qsgd(bits=4, **kw),
    "onebit": lambda **kw: jaxcomp.onebit(**kw),
    "terngrad": lambda **kw: jaxcomp.terngrad(**kw),
    "powersgd": lambda **kw: jaxcomp.powersgd(1, **kw),
    "onebit_adam": lambda **kw: jaxcomp.onebit_adam(0.1, freeze_step=2, **kw),
    "zero_one_adam": lambda **kw: jaxcomp.zero_one_adam(0.1, var_freeze_step=2, **kw),
}

# A bad value of each common option and the one message every factory gives.
BAD_COMMON = {
    "nonfinite": ("drop", f"nonfinite must be one of {NONFINITE_POLICIES}, got 'drop'"),
    "min_dense_size": (-1, "min_dense_size must be"),
    "residual_dtype": (jnp.int32, "residual_dtype must be"),
    "seed": (2**40, "seed must be"),
}


def _takes(factory_name: str, option: str) -> bool:
    fn = jaxcomp.sparsify if factory_name == "sparsify" else getattr(jaxcomp, factory_name)
    return option in inspect.signature(fn).parameters


@pytest.mark.parametrize("option", sorted(BAD_COMMON))
def test_every_compressor_rejects_a_bad_common_option_with_one_message(option):
    value, start = BAD_COMMON[option]
    messages = {}
    for name, make in FACTORIES.items():
        if not _takes(name, option):
            continue
        with pytest.raises(ValueError) as info:
            make(**{option: value})
        messages[name] = str(info.value)
    assert len(messages) >= 6, messages
    assert all(m.startswith(start) for m in messages.values()), messages
    assert len(set(messages.values())) == 1, messages


def test_named_sparsifiers_forward_every_common_keyword():
    sparsify_params = inspect.signature(jaxcomp.sparsify).parameters
    assert set(sparsifiers.COMMON_KEYWORDS) <= set(sparsify_params)
    assert len(sparsifiers.COMMON_KEYWORDS) >= 16
    for name in sparsifiers.__all__:
        factory = getattr(sparsifiers, name)
        if not callable(factory):
            continue
        params = inspect.signature(factory).parameters
        for keyword in sparsifiers.COMMON_KEYWORDS:
            assert keyword in params, f"{name} lacks {keyword}"
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, (name, keyword)
            assert params[keyword].default == sparsify_params[keyword].default, (name, keyword)


# The package's layers, lowest first: a module imports only from its own unit
# or a lower layer (a unit is a subpackage or a top-level module of jaxcomp).
LAYERS = (
    ("_validation", "_vma", "_sharding"),
    ("selection", "quantization", "sampling", "analysis", "ensemble"),
    ("comm", "coding"),
    ("planning", "transforms"),
    ("distributed",),
    ("aggregation", "cssgd", "staleness"),
    ("elastic",),
)


def _imports():
    """``(importing module, imported jaxcomp module)`` pairs, lazy imports included."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    out = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        user = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                owner = _resolve(user, node, path.name == "__init__.py")
                for alias in node.names:
                    full = f"{owner}.{alias.name}"
                    target = full if full in modules else owner
                    if target in modules and target != user:
                        out.add((user, target))
            elif isinstance(node, ast.Import):
                out |= {(user, a.name) for a in node.names if a.name in modules and a.name != user}
    return sorted(out)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward_imports(layers) -> list:
    layer = {unit: i for i, units in enumerate(layers) for unit in units}
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {""}
    assert units == set(layer), f"units without a layer: {units - set(layer)}"
    return [
        (user, target)
        for user, target in _imports()
        if _unit(user)
        and _unit(target) != _unit(user)
        and layer[_unit(target)] >= layer[_unit(user)]
    ]


def test_no_import_runs_up_the_layers():
    up = _upward_imports(LAYERS)
    assert not up, "imports running up (or across) the layers:\n" + "\n".join(
        f"  {u} -> {t}" for u, t in up
    )


def test_no_circular_imports():
    graph = {}
    for user, target in _imports():
        graph.setdefault(user, set()).add(target)
    # A package imports its submodules to re-export them: not a cycle of code.
    graph = {u: {t for t in ts if not t.startswith(u + ".")} for u, ts in graph.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "circular imports:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_import_checks_see_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """Planted: transforms/b.py imports distributed (up, lazily), and a cycle a <-> b."""
    fake = tmp_path / "jaxcomp"
    for sub in ("transforms", "distributed"):
        (fake / sub).mkdir(parents=True)
        (fake / sub / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "transforms" / "a.py").write_text("from jaxcomp.transforms import b\n")
    (fake / "transforms" / "b.py").write_text(
        "def f():\n    from jaxcomp.transforms import a\n    from jaxcomp.distributed import c\n"
    )
    (fake / "distributed" / "c.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    layers = (("distributed",), ("transforms",))  # transforms above distributed: no error
    assert _upward_imports(layers) == []
    layers = (("transforms",), ("distributed",))
    assert _upward_imports(layers) == [("jaxcomp.transforms.b", "jaxcomp.distributed.c")]
    with pytest.raises(AssertionError, match="jaxcomp.transforms.a -> jaxcomp.transforms.b"):
        test_no_circular_imports()


def test_no_circular_imports_in_experiments(monkeypatch):
    experiments = PACKAGE.parent / "experiments"
    assert (experiments / "train.py").is_file()
    monkeypatch.setattr(__import__(__name__), "PACKAGE", experiments)
    test_no_circular_imports()


def _vocabulary_rows():
    page = (PACKAGE.parent / "docs" / "vocabulary.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and cells[0] != "`exchange` default":
            rows[cells[0].strip("`")] = cells[1:]
    return rows


# The constants the table's `exchange` names column refers to.
_EXCHANGE_NAMES = {
    "sparse_allreduce.EXCHANGES": "jaxcomp.comm.sparse_allreduce.EXCHANGES",
    "QUANTIZER_EXCHANGES": "jaxcomp.comm.quantized.QUANTIZER_EXCHANGES",
    "VOTE_EXCHANGES": "jaxcomp.comm.quantized.VOTE_EXCHANGES",
    "ADAM_EXCHANGES": "jaxcomp.transforms.adam.ADAM_EXCHANGES",
}


def _constant(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _required_arguments(params) -> dict:
    """Cheap values for the arguments without a default, to build a factory."""
    from jaxcomp.transforms.quantize import sign_quantizer  # noqa: PLC0415

    values = {
        "selector": "top_k",
        "ratio": 0.1,
        "quantizer": sign_quantizer(),
        "rank": 1,
        "learning_rate": 0.01,
        "threshold": 1.0,
        "freeze_step": 2,
        "var_freeze_step": 2,
    }
    out = {p: values[p] for p, v in params.items() if v.default is v.empty}
    return {**out, "levels": 4} if "levels" in params else out  # qsgd: levels or bits


def test_every_factory_matches_the_vocabulary_table():
    """docs/vocabulary.md's table is the signatures' (positional arguments, defaults, names)."""
    rows = _vocabulary_rows()
    assert len(rows) >= 20, rows
    factories = [n for n in jaxcomp.__all__ if n in rows]
    assert sorted(factories) == sorted(rows), set(rows) ^ set(factories)
    aliases = tuple(jaxcomp.comm.EXCHANGE_ALIASES)
    for name, (positional, exchange, names, error_feedback, beta) in rows.items():
        factory = getattr(jaxcomp, name)
        params = inspect.signature(factory).parameters
        leading = [p for p, v in params.items() if v.kind is v.POSITIONAL_OR_KEYWORD]
        expected = f"`{', '.join(leading)}`" if leading else "-"
        assert positional == expected, (name, positional, expected)
        shown = "-" if "exchange" not in params else f'`"{params["exchange"].default}"`'
        assert exchange == shown, (name, exchange, shown)
        if "error_feedback" in params:
            assert error_feedback == f"`{params['error_feedback'].default}`", name
        else:
            assert error_feedback == "-", name
        # `momentum` is DGC's momentum correction only; Signum's moving average is `beta`.
        if "beta" in params:
            assert beta.startswith("`beta`"), (name, beta)
        elif "momentum" in params:
            assert beta == "DGC momentum correction", (name, beta)
        else:
            assert beta == "-", (name, beta)
        # Every name of the exchange column builds (aliases too, for the sparsifiers).
        if "exchange" not in params:
            assert names == "-", name
            continue
        accepted = [e for c in names.split(", ") for e in _constant(_EXCHANGE_NAMES[c.strip("`")])]
        assert params["exchange"].default in accepted, name
        if "sparse_allreduce.EXCHANGES" in names:
            accepted += aliases
        for e in accepted:
            factory(**_required_arguments(params), axis_name="data", exchange=e)


# The step skeleton: the step builders (the units at or above ``distributed``)
# compose the pieces of one module; none writes its own per-device stacked
# state or its own unchecked shard_map. (Lower layers are no step builders:
# ``comm.quantized``'s per-device vmap slices rows for another reason.)
SKELETON = "jaxcomp.distributed.skeleton"
STEP_BUILDERS = ("distributed", "aggregation", "cssgd", "staleness", "elastic")


def _is_row_lambda(node) -> bool:
    """``lambda x: x[0]``, ``lambda x: x[None]`` or ``lambda x: jnp.asarray(x)[None]``."""
    if not (isinstance(node, ast.Lambda) and len(node.args.args) == 1):
        return False
    body, arg = node.body, node.args.args[0].arg
    if not isinstance(body, ast.Subscript):
        return False
    value = body.value
    if isinstance(value, ast.Call) and len(value.args) == 1:
        value = value.args[0]  # jnp.asarray(x)
    row = isinstance(body.slice, ast.Constant) and body.slice.value in (0, None)
    return row and isinstance(value, ast.Name) and value.id == arg


def _is_unchecked_shard_map(node) -> bool:
    """A ``shard_map(..., check_vma=False)`` call."""
    if not isinstance(node, ast.Call):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return name == "shard_map" and any(
        k.arg == "check_vma" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in node.keywords
    )


def _skeleton_copies() -> list:
    """``(module, line, what)`` for each piece of the step skeleton written outside it."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == SKELETON or _unit(module) not in STEP_BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_row_lambda(node):
                out.append((module, node.lineno, "device_slice/device_stack"))
            elif _is_unchecked_shard_map(node):
                out.append((module, node.lineno, "shard_step"))
    return sorted(out)


def test_one_step_skeleton():
    copies = _skeleton_copies()
    assert not copies, f"step skeleton pieces re-written outside {SKELETON} (use them):\n" + (
        "\n".join(f"  {m}:{line}: write {what}" for m, line, what in copies)
    )


def test_the_skeleton_check_sees_a_copy(tmp_path, monkeypatch):
    """Planted: a builder with its own row slicing and shard_map; the skeleton's own are fine."""
    fake = tmp_path / "jaxcomp"
    (fake / "distributed").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "distributed" / "__init__.py").write_text("")
    code = (
        "state = jax.tree.map(lambda x: x[0], opt_state)\n"
        "out = jax.tree.map(lambda y: jnp.asarray(y)[None], state)\n"
        "first = jax.tree.map(lambda x: x[1], state)\n"  # not the convention
        "f = jax.shard_map(g, mesh=m, in_specs=P(), out_specs=P(), check_vma=False)\n"
        "h = jax.shard_map(g, mesh=m, in_specs=P(), out_specs=P(), check_vma=True)\n"
    )
    (fake / "distributed" / "skeleton.py").write_text(code)
    (fake / "staleness.py").write_text(code)
    (fake / "sampling.py").write_text(code)  # below distributed: no step builder
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _skeleton_copies() == [
        ("jaxcomp.staleness", 1, "device_slice/device_stack"),
        ("jaxcomp.staleness", 2, "device_slice/device_stack"),
        ("jaxcomp.staleness", 4, "shard_step"),
    ]
