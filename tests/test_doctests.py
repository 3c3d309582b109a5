"""Every docstring example in the jaxcomp package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

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
