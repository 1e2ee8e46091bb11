"""The package's declared requirements (pyproject.toml) against the lock files: exact pins,
floors, the locked versions. ``make compat`` prints its install constraints from here:

    python -m tests.support.metadata floors --extra loader --locked pytest psutil
    # pyarrow==16 ... torch==2.6 (each floor of the core and the loader), pytest==9.2.0 (the lock's)
    python -m tests.support.metadata lock --extra loader --locked pytest psutil
    # the same names at requirements.lock's versions
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def requirements(project: dict, extras=None) -> dict[str, list[Requirement]]:
    """``{"": core, extra: [...]}`` (``extras``: those only), less the self-references
    (``userwise[...]`` in ``all``)."""
    groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    name = canonicalize_name(project["name"])
    return {g: [r for r in map(Requirement, reqs) if canonicalize_name(r.name) != name]
            for g, reqs in groups.items() if extras is None or g == "" or g in extras}


def exact_pins(reqs) -> list[str]:
    """The requirements that pin one version (``==``, also ``==1.*``, or ``===``)."""
    return [str(r) for r in map(_req, reqs) if any(s.operator in ("==", "===") for s in r.specifier)]


def floor(req) -> str | None:
    """The lower bound of ``>=`` (or ``~=``), else None."""
    lows = [s.version for s in _req(req).specifier if s.operator in (">=", "~=")]
    return lows[0] if len(lows) == 1 else None


def locked(path: Path) -> dict[str, str]:
    """``{name: version}`` of a lock file's ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def outside_ranges(groups: dict[str, list[Requirement]], lock: dict[str, str]) -> list[str]:
    """Every declared requirement whose locked version its range refuses (or that the lock lacks)."""
    bad = []
    for group, reqs in groups.items():
        for r in reqs:
            v = lock.get(canonicalize_name(r.name))
            if v is None:
                bad.append(f"[{group or 'core'}] {r}: not in the lock")
            elif not r.specifier.contains(v, prereleases=True):
                bad.append(f"[{group or 'core'}] {r}: locked at {v}")
    return bad


def _req(r) -> Requirement:
    return r if isinstance(r, Requirement) else Requirement(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Constraints for make compat: each requirement of the core and "
                                "the given extras at its floor (floors) or at requirements.lock's version (lock), "
                                "and --locked names at the lock's version.")
    p.add_argument("versions", choices=["floors", "lock"])
    p.add_argument("--extra", action="append", default=[], help="an extra whose requirements to add (repeatable)")
    p.add_argument("--locked", nargs="*", default=[], metavar="NAME", help="more names, at requirements.lock's version")
    args = p.parse_args(argv)
    lock = locked(ROOT / "requirements.lock")
    lines = {}
    for group, reqs in requirements(pyproject(), args.extra).items():
        for r in reqs:
            v = floor(r) if args.versions == "floors" else lock.get(canonicalize_name(r.name))
            if v is None:
                raise SystemExit(f"{r} ({group or 'core'}): no {'floor' if args.versions == 'floors' else 'locked version'}")
            lines[canonicalize_name(r.name)] = f"{r.name}=={v}"
    for name in args.locked:
        lines[canonicalize_name(name)] = f"{name}=={lock[canonicalize_name(name)]}"
    print("\n".join(lines.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
