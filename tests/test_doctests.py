"""Every docstring example in the jaxcomp package runs and prints what it shows.

And every public symbol is documented, by this rule (what
``test_every_public_symbol_is_documented`` checks):

* Public symbols are the names in the ``__all__`` of ``jaxcomp`` and of every
  module ``pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp.")`` finds whose own
  name does not start with ``_`` (so ``jaxcomp._validation`` or
  ``jaxcomp.selection._kernels`` are private, with everything in them).
* Every public function, and every public class that is not an optimizer-state
  NamedTuple or an exception (factories, helpers, configs, reports, plans,
  result tuples), has a Google-style docstring with an ``Example:`` (or
  ``Examples:``) section holding at least one ``>>>`` doctest. Those doctests
  run in ``test_docstring_examples`` below, so they are true; keep them fast:
  tiny arrays, ``jax.make_mesh((1,), ("data",))`` for anything with an axis,
  no training loop of more than a few steps, and print something checkable.
* Exempt from the example, still documented:

  - optimizer-state NamedTuples (``XxxState``, as in optax): a docstring of
    their own naming every field (what each holds);
  - exceptions: a docstring of their own;
  - submodules listed in an ``__all__``: a module docstring;
  - constants (tuples, dicts, strings, numbers): a comment on the line before
    (or after, on) their assignment, or an attribute docstring after it, in the
    module that assigns them.

Doctest outputs are ``repr``s: a ``PartitionSpec`` prints as ``P('data',)`` or
``P('data', None)``, as in ``w.sharding.spec``.
"""

import ast
import doctest
import importlib
import inspect
import pkgutil
import re

import pytest

import jaxcomp


def _modules():
    names = ["jaxcomp"]
    for info in pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp."):
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def _public_modules():
    return [n for n in _modules() if not any(p.startswith("_") for p in n.split("."))]


def _public_symbols():
    """``(module name, symbol name, object)`` for every name in a public ``__all__``."""
    out = []
    for name in _public_modules():
        module = importlib.import_module(name)
        for symbol in getattr(module, "__all__", ()):
            out.append((name, symbol, getattr(module, symbol)))
    return out


def _own_doc(obj):
    """The object's own docstring, cleaned, or "" (not inherited, not generated)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return ""
    doc = inspect.cleandoc(doc)
    # NamedTuple and dataclass generate "Name(field, ...)" when no docstring is given.
    if inspect.isclass(obj) and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc):
        return ""
    return doc


def _has_example_section(doc):
    """Whether ``doc`` has an ``Example:``/``Examples:`` section holding a ``>>>`` line."""
    lines = doc.split("\n")
    for i, line in enumerate(lines):
        head = re.fullmatch(r"(\s*)Examples?:\s*", line)
        if not head:
            continue
        indent = len(head.group(1))
        for body in lines[i + 1 :]:
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break
            if body.lstrip().startswith(">>>"):
                return True
    return False


def _is_state_tuple(obj, symbol):
    return (
        inspect.isclass(obj)
        and issubclass(obj, tuple)
        and hasattr(obj, "_fields")
        and symbol.endswith("State")
    )


_SOURCES = {}


def _assignment_documented(symbol, obj):
    """Whether a module assigning ``symbol = obj`` documents it (comment or docstring).

    Looks in every jaxcomp module (also private ones) whose attribute ``symbol``
    is ``obj`` and whose source assigns it at top level; None if none does.
    """
    found = None
    for name in _modules():
        module = importlib.import_module(name)
        if getattr(module, symbol, None) is not obj:
            continue
        if name not in _SOURCES:
            source = inspect.getsource(module)
            _SOURCES[name] = (source.split("\n"), ast.parse(source).body)
        lines, body = _SOURCES[name]
        for k, stmt in enumerate(body):
            if isinstance(stmt, ast.Assign):
                targets = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                targets = [stmt.target.id]
            else:
                continue
            if symbol not in targets:
                continue
            before = lines[stmt.lineno - 2].strip() if stmt.lineno >= 2 else ""
            after = body[k + 1] if k + 1 < len(body) else None
            documented = (
                before.startswith("#")
                or re.search(r"\s#\s", lines[stmt.lineno - 1]) is not None
                or (
                    isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                )
            )
            found = bool(found) or documented
    return found


def _problem(symbol, obj):
    """What is missing from this public symbol's documentation, or None."""
    if inspect.ismodule(obj):
        return None if (obj.__doc__ or "").strip() else "module without a docstring"
    if inspect.isclass(obj) or callable(obj):
        doc = _own_doc(obj)
        if not doc:
            return "no docstring"
        if _is_state_tuple(obj, symbol):
            missing = [f for f in obj._fields if not re.search(rf"\b{re.escape(f)}\b", doc)]
            return f"state docstring does not describe fields {missing}" if missing else None
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            return None
        return None if _has_example_section(doc) else "no 'Example:' section with a doctest"
    documented = _assignment_documented(symbol, obj)
    if documented is None:
        return "constant whose assignment was not found"
    return None if documented else "constant without a comment or docstring at its assignment"


def test_every_public_symbol_is_documented():
    problems, seen = [], set()
    for module, symbol, obj in _public_symbols():
        key = (symbol, id(obj))
        if key in seen:  # a re-export: the same object checked once, under its first name
            continue
        seen.add(key)
        problem = _problem(symbol, obj)
        if problem:
            problems.append(f"{module}.{symbol}: {problem}")
    assert not problems, f"{len(problems)} public symbols lack documentation:\n" + "\n".join(
        problems
    )


def test_documentation_rule_is_not_vacuous():
    # The walk must see the package's public API (else the test above passes on nothing),
    # and the rule must reject what it should.
    symbols = {(m, s) for m, s, _ in _public_symbols()}
    assert ("jaxcomp", "top_k") in symbols and ("jaxcomp.comm", "sparse_mean") in symbols
    assert not any(m.split(".")[-1].startswith("_") for m, _ in symbols)
    assert len(symbols) > 300

    def no_example(x):
        """Adds one.

        Returns:
          ``x + 1``.
        """
        return x + 1

    def example_elsewhere(x):
        """Adds one.

        >>> example_elsewhere(1)
        2
        """
        return x + 1

    def with_example(x):
        """Adds one.

        Example:
          >>> with_example(1)
          2
        """
        return x + 1

    assert _problem("no_example", no_example)
    assert _problem("example_elsewhere", example_elsewhere)
    assert _problem("with_example", with_example) is None
    from typing import NamedTuple

    class FooState(NamedTuple):
        """State: ``count`` steps so far."""

        count: int
        residual: int

    assert "residual" in _problem("FooState", FooState)
    assert _problem("Plain", type("Plain", (), {})) == "no docstring"  # object's doc not inherited
