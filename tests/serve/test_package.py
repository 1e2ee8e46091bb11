"""The serving package never imports pyspark (a serving process has no JVM). Its public face
(the ``Public names::`` block is exactly ``__all__``, every public class and function has an
``Example::``) is checked with every other package's in tests/ops/test_public_api.py."""

from __future__ import annotations

from tests.ops.test_layers import imports, modules


def test_serving_never_imports_pyspark():
    hits = [n for n, p in modules().items() if n.startswith("pipelines.serve") and "pyspark" in imports(p)]
    assert hits == [] and any(n.startswith("pipelines.serve.") for n in modules())
