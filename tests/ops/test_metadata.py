"""The library's metadata gives ranges, the lock files the exact versions: a trainer's image
keeps its own torch, numpy and pyarrow, CI and the demo keep theirs (docs/install.md)."""

from __future__ import annotations

import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.metadata import ROOT, exact_pins, floor, locked, outside_ranges, pyproject, requirements
from tests.support.wheels import build_userwise_wheel

SUPPORTED = ("3.11", "3.12", "3.13")


def test_no_exact_pin_in_the_library_requirements():
    groups = requirements(pyproject())
    assert set(groups) >= {"", "spark", "loader", "torchrec", "gds", "airflow", "test"}
    assert {g: exact_pins(reqs) for g, reqs in groups.items() if exact_pins(reqs)} == {}


def test_the_pin_check_finds_a_pin():
    reqs = ["torch>=2.6,<3", "numpy==2.4.6", "a===1.0", "b==2.*", "moto[s3]==5.2.5; python_version < '3.14'",
            "c!=1.0,>=0.5", "d"]
    assert exact_pins(reqs) == ["numpy==2.4.6", "a===1.0", "b==2.*", 'moto[s3]==5.2.5; python_version < "3.14"']


def test_core_and_loader_have_floors():
    """`make compat` installs these floors; a requirement without one would go untested."""
    groups = requirements(pyproject(), extras=["loader"])
    assert [str(r) for reqs in groups.values() for r in reqs if floor(r) is None] == []
    assert floor("torch>=2.6,<3") == "2.6" and floor("torch<3") is None


def test_every_locked_version_is_inside_the_ranges():
    lock = locked(ROOT / "requirements.lock")
    assert lock["torch"] and lock["pyarrow"] and lock["numpy"]
    assert outside_ranges(requirements(pyproject()), lock) == []


def test_the_range_check_finds_a_locked_version_outside():
    groups = {"": [Requirement("numpy>=2.0,<3")], "loader": [Requirement("torch>=2.6,<2.13"), Requirement("numba")]}
    assert outside_ranges(groups, {"numpy": "2.4.6", "torch": "2.13.0"}) == [
        "[loader] torch<2.13,>=2.6: locked at 2.13.0", "[loader] numba: not in the lock"]


def test_the_lock_parser_reads_pins_and_skips_comments(tmp_path):
    (tmp_path / "r.lock").write_text("# via x\nNumPy==2.4.6\n    # via\nmoto[s3]==5.2.5 ; python_version < '4'\n"
                                     "torch==2.13.0+cu130\n")
    assert locked(tmp_path / "r.lock") == {"numpy": "2.4.6", "moto": "5.2.5", "torch": "2.13.0+cu130"}


def test_python_3_11_to_3_13_are_supported():
    project = pyproject()
    spec = SpecifierSet(project["requires-python"])
    assert [v for v in SUPPORTED if v not in spec] == []
    assert "3.10" not in spec and "3.14" not in spec
    classified = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")}
    assert classified == set(SUPPORTED)


def test_the_wheel_metadata_has_ranges(tmp_path):
    """The built wheel says what pyproject says: Requires-Dist without pins, Requires-Python 3.11-3.13."""
    wheel = build_userwise_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    headers = [line.split(": ", 1) for line in meta.split("\n\n", 1)[0].splitlines() if ": " in line]
    requires = [v for k, v in headers if k == "Requires-Dist"]
    assert any(r.startswith("torch") and 'extra == "loader"' in r for r in requires)
    assert exact_pins(requires) == []
    spec = SpecifierSet(dict(headers)["Requires-Python"])
    assert [v for v in SUPPORTED if v not in spec] == [] and "3.14" not in spec
