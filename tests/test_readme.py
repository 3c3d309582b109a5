"""The README's and docs/*.md's Python examples run as written and print what their comments say."""

import ast
import contextlib
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from helpers import compile_flags_without_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README and the documentation's pages: each one's examples run the same way.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Blocks that need a set-up a test process cannot give (a fresh JAX per process).
SKIP = ("initialize_multiprocess",)


def _python_blocks(page=README):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _page_id(page):
    return str(page.relative_to(ROOT))


# The pages with examples (the parametrization of the tests that run them).
PAGES_WITH_EXAMPLES = [page for page in PAGES if _python_blocks(page)]


def _printed_claims(block):
    """``print(...)  # {literal}...`` lines: the literal each one claims to print."""
    claims = []
    for line in block.splitlines():
        if not line.startswith("print("):
            continue
        comment = line.partition("#")[2].strip()
        match = re.match(r"(\{[^}]*\}|\([^)]*\)|\d+)", comment)
        # "{'b': 256, 'w': ...} (1311..1966)" claims a range: checked on its own below.
        exact = match is not None and "..." not in match.group(1)
        claims.append(ast.literal_eval(match.group(1)) if exact else None)
    return claims


# A block for several devices says so on its first line (and how to simulate them).
NEEDS_DEVICES = "# Needs "

# Runs one page's blocks in one namespace on ONE device, in a fresh process
# (this one has 8 simulated devices): one JSON line per block, what it printed
# or how it failed, then the device count.
_ONE_DEVICE_RUN = """
import contextlib, io, json, re, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
text = open(sys.argv[1]).read()
ns = {}
exec("import jax, jax.numpy as jnp, optax, jaxcomp", ns)
for i, block in enumerate(re.findall(r"```python\\n(.*?)```", text, flags=re.S)):
    if any(s in block for s in sys.argv[2:]):
        continue
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block, sys.argv[1], "exec"), ns)
        print(json.dumps({"block": i, "printed": out.getvalue()}))
    except Exception as e:
        print(json.dumps({"block": i, "error": f"{type(e).__name__}: {e}"[:400]}))
print(json.dumps({"devices": jax.device_count()}))
"""


def _run_in_namespace(block, namespace, page=README):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102
    return out.getvalue()


def test_readme_has_examples():
    assert len(_python_blocks()) >= 1
    blocks = [b for page in PAGES for b in _python_blocks(page)]
    one_device = [b for b in blocks if not any(s in b for s in (*SKIP, NEEDS_DEVICES))]
    assert len(blocks) >= 5 and len(one_device) >= 20
    # Printed claims checked literally: the QSGD message_bytes claim at least.
    assert sum(c is not None for b in blocks for c in _printed_claims(b)) >= 1


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=_page_id)
def test_readme_blocks_run_and_print_what_they_claim(page):
    """Every block of the page runs and prints what its comments claim, once each.

    A reader with one GPU (a Colab) runs every example, except those that say
    on their first line how many devices they need and how to simulate them:
    those run here (8 simulated devices), each in a namespace of its own (a
    reader starts a fresh process for them); the others run in reading order in
    one namespace on ONE device, in a fresh process (later snippets use earlier
    ones' names, such as ``params``, as a reader pasting them into one notebook
    would). Each page is a notebook of its own: it runs without the others.
    """
    blocks = _python_blocks(page)
    for block in blocks:
        if block.startswith(NEEDS_DEVICES):
            assert "xla_force_host_platform_device_count" in block.split("\n", 3)[1], block[:200]
    # No simulated devices: the one CPU device (compiled as fast as the tests).
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=compile_flags_without_devices())
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_DEVICE_RUN, str(page), *SKIP, NEEDS_DEVICES],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *runs, last = [json.loads(line) for line in proc.stdout.splitlines()]
    assert last == {"devices": 1}, last
    assert [r for r in runs if "error" in r] == []
    printed = {r["block"]: r["printed"] for r in runs}
    expected = [i for i, b in enumerate(blocks) if not any(s in b for s in (*SKIP, NEEDS_DEVICES))]
    assert sorted(printed) == expected, sorted(printed)
    for i, block in enumerate(blocks):
        if block.startswith(NEEDS_DEVICES):
            namespace: dict = {}
            exec("import jax, jax.numpy as jnp, optax, jaxcomp", namespace)  # noqa: S102
            printed[i] = _run_in_namespace(block, namespace, page)
    for i, text in sorted(printed.items()):
        lines, claims = text.splitlines(), _printed_claims(blocks[i])
        assert len(lines) == len(claims), (i, blocks[i][:200])
        for line, claim in zip(lines, claims, strict=True):
            if claim is not None:
                assert ast.literal_eval(line) == claim, (i, line, claim)


@pytest.mark.parametrize("block", [b for b in _python_blocks() if "sent_count" in b][:1])
def test_readme_usage_sent_count_in_window(block):
    """The usage example's claim: 'b' dense (256) and 'w' in [k, 1.5 k]."""
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    import optax

    import jaxcomp

    counts = jaxcomp.statistics(namespace["opt_state"])["sent_count"]
    assert optax.tree.get(namespace["opt_state"], "sent_count").shape == (2,)  # per leaf
    k = math.ceil(0.01 * 512 * 256)
    assert int(counts["b"]) == 256 and k <= int(counts["w"]) <= int(1.5 * k)


def _github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _slugs(page):
    """The anchors of a page's headings (not of ``#`` comments in its code blocks)."""
    in_code, slugs = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slugs.add(_github_slug(line.lstrip("#")))
    return slugs


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_readme_internal_links_resolve(page):
    """Every ``](#anchor)`` and ``](page.md#anchor)`` link: a heading there, the file there."""
    text = page.read_text()
    if page == README:
        assert re.search(r"\]\(#", text), "the README links its own sections"
    for target, anchor in re.findall(r"\]\(([\w./-]*\.(?:md|ipynb|py)|)(?:#([^)]+))?\)", text):
        path = (page.parent / target) if target else page
        assert path.exists(), (page.name, target)
        if anchor:
            assert anchor in _slugs(path), (page.name, target, anchor)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_readme_images_exist(page):
    """Every image a page shows is a file in the repository (a relative path)."""
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())
    for path in images:
        assert not path.startswith(("http:", "https:", "/")), path
        assert (page.parent / path).is_file(), path
    if page.name == "distributed.md":
        assert images, "the page shows the exchanges' scaling plot"
