"""The serving package's public face: its ``Public names::`` block is exactly its ``__all__``,
every public class and function documents itself with an ``Example::``, and it never imports
pyspark (a serving process has no JVM)."""

from __future__ import annotations

import inspect
import re

import userwise.pipelines.serve as serve
from tests.ops.test_layers import imports, modules


def test_the_public_names_block_is_exactly_all():
    doc = serve.__doc__
    block = doc[doc.index("Public names::"):].split("\n\n")[1]
    names = re.findall(r"\w+", block.split("import", 1)[1])
    assert names == serve.__all__


def test_every_public_class_and_function_has_an_example():
    missing = []
    for name in serve.__all__:
        obj = getattr(serve, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if "Example::" not in (obj.__doc__ or ""):
                missing.append(name)
    assert missing == []


def test_serving_never_imports_pyspark():
    hits = [n for n, p in modules().items() if n.startswith("pipelines.serve") and "pyspark" in imports(p)]
    assert hits == [] and any(n.startswith("pipelines.serve.") for n in modules())
