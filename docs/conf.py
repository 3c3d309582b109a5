"""Sphinx configuration: the docs/*.md pages (MyST) and an API reference from the docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(``make docs``). The API pages under ``docs/api/`` are written here, at every
build, from the ``__all__`` of ``jaxcomp`` and of its public modules, so a new
public name is documented without editing the docs (``docs/api/`` is not
committed).
"""

import importlib
import inspect
import pathlib
import sys

from sphinx.pycode import ModuleAnalyzer

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "jaxcomp"
author = "jaxcomp authors"
copyright = "jaxcomp authors, Apache-2.0"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []

# MyST: GitHub-style anchors for headings, so `page.md#a-heading` links (as
# GitHub renders them) resolve in the site too.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

# Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections as :ivar: fields: as attribute directives they would
# describe a NamedTuple state's fields a second time (autodoc lists them too).
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autosummary_generate = False

# The public modules, in the order of the API reference.
PUBLIC_MODULES = (
    "jaxcomp",
    "jaxcomp.transforms",
    "jaxcomp.transforms.two_level",
    "jaxcomp.selection",
    "jaxcomp.selection.ldte",
    "jaxcomp.selection.multistage",
    "jaxcomp.quantization",
    "jaxcomp.comm",
    "jaxcomp.coding",
    "jaxcomp.distributed",
    "jaxcomp.aggregation",
    "jaxcomp.ensemble",
    "jaxcomp.staleness",
    "jaxcomp.sampling",
    "jaxcomp.elastic",
    "jaxcomp.cssgd",
    "jaxcomp.planning",
    "jaxcomp.analysis",
)


def _entry(module: str, attr: str, obj, attr_docs) -> list[str]:
    """The directive documenting ``module.attr``."""
    if inspect.isclass(obj):
        return [f".. autoclass:: {module}.{attr}", "   :members:"]
    if callable(obj):
        return [f".. autofunction:: {module}.{attr}"]
    if ("", attr) in attr_docs:  # a ``#:`` comment or a docstring after it
        return [f".. autodata:: {module}.{attr}"]
    # No documentation of its own: autodata would show its type's docstring
    # (``dict``'s, for a table of selectors).
    return [f".. py:data:: {module}.{attr}", f"   :type: {type(obj).__name__}"]


def _write_api_pages() -> None:
    """docs/api/<module>.rst for each public module: each ``__all__`` name once.

    A name re-exported by several modules (``jaxcomp.ldte_bs`` is
    ``jaxcomp.transforms.ldte_bs``) is documented where it first appears in
    PUBLIC_MODULES and linked from the other pages; a submodule in an
    ``__all__`` gets a page of its own.
    """
    out = ROOT / "docs" / "api"
    out.mkdir(exist_ok=True)
    documented: dict[int, str] = {}
    queue, pages = list(PUBLIC_MODULES), []
    while queue:
        name = queue.pop(0)
        if name in pages:
            continue
        pages.append(name)
        module = importlib.import_module(name)
        title = f"``{name}``"
        lines = [title, "=" * len(title), "", f".. automodule:: {name}", ""]
        own, elsewhere, submodules = [], [], []
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.ismodule(obj):
                submodules.append(obj.__name__)
                if obj.__name__ not in PUBLIC_MODULES:
                    queue.append(obj.__name__)
            elif id(obj) in documented and not isinstance(obj, (int, float, str, bool)):
                elsewhere.append((attr, documented[id(obj)]))
            else:
                own.append((attr, obj))
                documented.setdefault(id(obj), f"{name}.{attr}")
        if submodules:
            refs = ", ".join(f":py:mod:`{m}`" for m in submodules)
            lines += [f"Submodules: {refs}.", ""]
        attr_docs = ModuleAnalyzer.for_module(name).find_attr_docs()
        # The table: what has a docstring of its own (not a dict's, say).
        summarised = [a for a, o in own if callable(o) or ("", a) in attr_docs]
        if summarised:
            lines += [".. autosummary::", ""]
            lines += [f"   {attr}" for attr in summarised]
            lines.append("")
        if elsewhere:
            refs = ", ".join(f":py:obj:`{attr} <{target}>`" for attr, target in elsewhere)
            lines += [f"Also exported here, documented under another name: {refs}.", ""]
        for attr, obj in own:
            lines += [*_entry(name, attr, obj, attr_docs), ""]
        _write_if_changed(out / f"{name}.rst", "\n".join(lines))
    toctree = ["API reference", "=============", "", ".. toctree::", "   :maxdepth: 1", ""]
    toctree += [f"   {name}" for name in pages]
    _write_if_changed(out / "index.rst", "\n".join(toctree) + "\n")


def _write_if_changed(path: pathlib.Path, text: str) -> None:
    """Rewrite only what changed, so an incremental build reads only those pages."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


_write_api_pages()
