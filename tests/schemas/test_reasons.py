"""Quarantine reasons: one vocabulary (schemas/reasons.py) used by the build, synth, the
edge-case logs and the docs. (That every reason a real build writes is in it is checked
on the build's own quarantine, in tests/builder/test_roundtrip.py.)"""

import ast
import re
from pathlib import Path

from tests.support import edgegen as E
from userwise import schemas
from userwise.pipelines.tools import synth
from userwise.schemas import reasons as R

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b")  # what a reason looks like: snake_case words
CONSTANTS = {k: v for k, v in vars(R).items() if k.isupper() and isinstance(v, str)}


def test_every_reason_is_a_constant_with_its_meaning():
    assert set(CONSTANTS.values()) == set(schemas.REASONS)
    assert all(k == v.upper() for k, v in CONSTANTS.items())
    assert all(NAME.fullmatch(r) and len(doc) > 10 for r, doc in schemas.REASONS.items())


def test_ingest_marks_rows_with_the_vocabulary_and_emits_all_of_it():
    """ingest names every reason through the constants (an unknown R.NAME fails here, a
    literal reason would bypass the vocabulary), and no reason is defined that nothing emits."""
    tree = ast.parse((ROOT / "pipelines/builder/ingest.py").read_text())
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "R"}
    assert used - {"REASONS"} <= set(CONSTANTS), used - set(CONSTANTS)
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in schemas.REASONS}
    assert not literals, f"reasons written as literals in ingest.py: {literals}"
    assert {CONSTANTS[a] for a in used if a in CONSTANTS} == set(schemas.REASONS)


def test_the_docs_list_exactly_the_vocabulary():
    text = (ROOT / "docs" / "commands.md").read_text()
    para = text[text.index("**Bad input**"):]
    para = para[:para.index("\n\n")]
    listed = {m for m in re.findall(r"`([^`]+)`", para) if NAME.fullmatch(m)}
    assert listed == set(schemas.REASONS), (listed ^ set(schemas.REASONS))


def test_the_quarantine_schema_names_only_reasons_of_the_vocabulary():
    doc = next(f.doc for f in schemas.QUARANTINE.fields if f.name == "reason")
    named = set(NAME.findall(doc))
    assert named and named <= set(schemas.REASONS), named - set(schemas.REASONS)


def test_synth_injects_faults_under_the_builds_names_and_documents_them():
    assert set(synth.BAD_REASONS) <= set(schemas.REASONS), set(synth.BAD_REASONS) - set(schemas.REASONS)
    assert len(set(synth.BAD_REASONS)) == len(synth.BAD_REASONS)
    doc = (ROOT / "docs/synth.md").read_text()
    table = doc[doc.index("| reason | the row |"):]
    table = table[:table.index("\n\n")]
    assert re.findall(r"^\| `([a-z_]+)` \|", table, re.M) == list(synth.BAD_REASONS)


def test_the_edge_logs_plant_reasons_of_the_vocabulary():
    assert set(E.REASON_COLUMNS) <= set(schemas.REASONS), set(E.REASON_COLUMNS) - set(schemas.REASONS)
