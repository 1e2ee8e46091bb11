"""The docs hold together: every relative link resolves, no file narrates history, no two
paths differ only in case (they collide on case-insensitive file systems)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "CONTRIBUTING.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# Diary wording: the docs describe the design as it is; git keeps the past. (Split so that
# this file does not match itself.)
DIARY = re.compile("|".join(["this " + "round", "earlier " + "machine", "earlier " + "rounds", r"session" + r" \d+"]),
                   re.IGNORECASE)
LOCKS = re.compile(r"(^|/)requirements[^/]*\.lock$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked() -> list[str]:
    """The repository's files: git's list where there is one, else the tree less the
    environments and caches a checkout makes."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not any(part.startswith(".") or part.endswith(".egg-info") or part == "demo"
                                           for part in p.relative_to(ROOT).parts)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.MULTILINE)}


def broken_links(doc: str) -> list[str]:
    path = ROOT / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code blocks are not links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{doc}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{doc}: {target} (no heading #{frag})")
    return bad


def test_slug_follows_github():
    assert slug("The pointer: semantics with a worked example") == "the-pointer-semantics-with-a-worked-example"
    assert slug("Reading Delta without Spark: pyarrow's filesystem, not delta-rs'") == \
        "reading-delta-without-spark-pyarrows-filesystem-not-delta-rs"
    assert slug("`loader_bench.py`: the loader") == "loader_benchpy-the-loader"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    assert (ROOT / doc).is_file(), f"{doc} is missing"
    assert broken_links(doc) == []


def test_the_link_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "a.md").write_text("# Top\n[ok](a.md#top) [gone](docs/nope.md) [anchor](#missing) "
                                   "[web](https://example.com)\n```\n[in code](x.md)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert broken_links("a.md") == ["a.md: docs/nope.md (no such file)", "a.md: #missing (no heading #missing)"]


def test_no_file_narrates_history():
    hits = []
    for rel in tracked():
        p = ROOT / rel
        if LOCKS.search(rel) or not p.is_file():
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:  # images and other binaries
            continue
        hits += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in DIARY.finditer(text)]
    assert hits == []


def test_no_two_paths_differ_only_in_case():
    seen: dict[str, str] = {}
    clash = []
    for rel in tracked():
        if rel.lower() in seen:
            clash.append((seen[rel.lower()], rel))
        seen[rel.lower()] = rel
    assert clash == []
