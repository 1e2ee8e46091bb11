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


# -- the README as a user's guide ------------------------------------------------------
README = ROOT / "README.md"
GUIDE_ORDER = ["## Two commands", "## Concepts", "## Your own log in five steps", "## What we promise",
               "## Deploy", "## Results", "## Reference"]
# What the Concepts block explains before the steps use it.
CONCEPTS = ["impression", "request", "lean log", "fat rows", "sample", "chunk", "pointer", "cost", "L", "H",
            "history", "as-of", "M", "N", "pretrain", "window", "set", "quarantine", "`JaggedBatch`"]
GUIDE_BYTES = 14 * 1024


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_is_a_guide_that_teaches_in_order():
    """Sections in a guide's order, at most 14 kB; every concept the steps use is explained
    in Concepts before them; benchmark figures live in benchmarks/README.md (the README's
    Results hold one summary line per plot)."""
    text = README.read_text()
    assert len(text.encode()) <= GUIDE_BYTES
    at = [text.index(h) for h in GUIDE_ORDER]
    assert at == sorted(at)
    concepts = text[text.index("## Concepts"):text.index("## Your own log")]
    for word in CONCEPTS:
        assert f"**{word}**" in concepts or f"**{word} (" in concepts, word
    results = text[text.index("## Results"):text.index("## Reference")]
    plots = re.findall(r"^!\[.*?\]\((benchmarks/results/\w+\.png)\)", results, re.MULTILINE)
    assert plots and all((ROOT / p).is_file() for p in plots)
    assert len([ln for ln in results.splitlines() if ln.startswith("- **")]) == len(plots)
    assert "benchmarks/README.md" in results


def test_the_two_commands_are_make_targets():
    first = fenced(README.read_text(), "bash")[0]
    targets = [ln.split()[1] for ln in first.splitlines() if ln.startswith("make ")]
    assert targets == ["demo", "test"]
    for t in targets:  # what they run: dry runs (make test is this suite; the guide below runs the demo's path)
        r = subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert "tools.demo" in subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True).stdout


def setup_line(guide: str) -> str:
    """The guide's own set-up line: the first line of its first shell block."""
    first = fenced(guide, "bash")[0].splitlines()[0]
    assert first.startswith(". .venv/bin/activate"), first
    return first


@pytest.mark.slow
def test_every_command_of_the_guide_runs_as_written(tmp_path):
    """The README's walk-through, block by block, in a fresh folder that has the checkout's
    environment as `.venv` (the user runs it in the checkout): each shell block after the
    guide's own set-up line, then the training loop with the environment's `python`. No
    PATH is patched; each must succeed exactly as printed."""
    import os
    import shlex

    text = README.read_text()
    guide = text[text.index("## Your own log in five steps"):text.index("## What we promise")]
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    setup = setup_line(guide)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT)))
    blocks = fenced(guide, "bash")
    assert len(blocks) >= 5 and any("userwise build" in b for b in blocks)
    for block in blocks:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{setup}\n{block}"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{block}\n--- stderr:\n{r.stderr[-3000:]}"
    assert (tmp_path / "nvme" / "manifest.json").is_file()
    (code,) = fenced(guide, "python")
    r = subprocess.run(["bash", "-c", f"{setup}\npython -c {shlex.quote(code)}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^\d+ impressions, last loss \d", r.stdout, re.MULTILINE), r.stdout
