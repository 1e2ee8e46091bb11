"""docker/spark/Dockerfile (the ``userwise-spark`` image of a Kubernetes job) holds what the
CLI uses, read from the code and the lock, never from a copy here: the jars ``userwise jars``
and the S3 store fetch (``pipelines/runtime/jars.py`` and its poms), resolved by the same
Maven command, and the Python packages at requirements.lock's versions. No Docker needed:
the Dockerfile is parsed."""

from __future__ import annotations

import re
import shlex
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.support.metadata import locked, pyproject, requirements
from userwise.pipelines.runtime import jars

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "spark" / "Dockerfile"
POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continued lines joined."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), " ".join(m.group(2).split()))
            for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.MULTILINE)]


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (a FROM starts one), ARGs before the first FROM apart."""
    out: list[list[tuple[str, str]]] = [[]]
    for ins in instructions(text):
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


@pytest.fixture(scope="module")
def dockerfile() -> str:
    assert DOCKERFILE.is_file(), "docker/spark/Dockerfile is missing"
    return DOCKERFILE.read_text()


def pom_packages(pom: Path) -> set[str]:
    """``group:artifact:version`` of every dependency of a pom, its ``${properties}`` resolved."""
    root = ET.parse(pom).getroot()
    props = {p.tag.split("}")[1]: p.text for p in root.findall("m:properties/*", POM_NS)}

    def text(dep, tag):
        return re.sub(r"\$\{([^}]+)\}", lambda m: props[m.group(1)], dep.find(f"m:{tag}", POM_NS).text.strip())

    return {f"{text(d, 'groupId')}:{text(d, 'artifactId')}:{text(d, 'version')}"
            for d in root.findall("m:dependencies/m:dependency", POM_NS)}


def pom_exclusions(pom: Path) -> set[str]:
    root = ET.parse(pom).getroot()
    return {f"{e.find('m:groupId', POM_NS).text}:{e.find('m:artifactId', POM_NS).text}"
            for e in root.findall("m:dependencies/m:dependency/m:exclusions/m:exclusion", POM_NS)}


def maven_command(pom: str, dest: str, monkeypatch) -> list[str]:
    """The Maven command ``userwise jars`` runs (``jars.maven_copy``) for ``pom`` into ``dest``."""
    seen = []
    monkeypatch.setattr(jars.shutil, "which", lambda name: name)
    monkeypatch.setattr(jars.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    assert jars.maven_copy(Path(pom), Path(dest), lambda m: None)
    return seen[0]


SETS = {"delta": jars.DELTA, "s3": jars.S3}  # the image's jar folders and the sets they hold


def test_the_poms_name_the_versions_jars_py_names():
    """The poms the image resolves and jars.py's packages (Spark's resolver) are one list;
    the S3 set's exclusions (Spark's resolver) are the pom's (Maven)."""
    for js in SETS.values():
        assert pom_packages(ROOT / "pipelines" / "runtime" / js.pom) == set(js.packages), js.name
    assert pom_exclusions(ROOT / "pipelines" / "runtime" / jars.S3.pom) == set(jars.S3.excludes)


def test_the_image_resolves_the_jars_as_userwise_jars_does(dockerfile, monkeypatch):
    """The jar stage copies the poms jars.py names and runs jars.maven_copy's command on each."""
    jar_stage = next(s for s in stages(dockerfile) if s[0][0] == "FROM" and s[0][1].endswith(" AS jars"))
    (copy,) = [a.split() for i, a in jar_stage if i == "COPY"]
    *sources, poms = copy
    assert sources == [f"pipelines/runtime/{js.pom}" for js in SETS.values()]
    assert all((ROOT / s).is_file() for s in sources)
    runs = " && ".join(a for i, a in jar_stage if i == "RUN").split(" && ")
    mvn = [shlex.split(c) for c in runs if c.startswith("mvn ")]
    expected = [maven_command(f"{poms}{js.pom}", f"/jars/{folder}", monkeypatch) for folder, js in SETS.items()]
    assert mvn == expected


def test_the_image_holds_the_jars_each_set_needs(dockerfile):
    """The build checks for exactly the files jars.DELTA and jars.S3 need (versions in the
    names), and copies both folders onto Spark's class path."""
    jar_stage = next(s for s in stages(dockerfile) if s[0][1].endswith(" AS jars"))
    runs = " && ".join(a for i, a in jar_stage if i == "RUN").split(" && ")
    (ls,) = [shlex.split(c)[1:] for c in runs if c.startswith("ls ")]
    listed: dict[str, set[str]] = {}
    for path in ls:
        folder, name = path.split("/")
        listed.setdefault(folder, set()).add(name)
    assert listed == {folder: set(js.needed) for folder, js in SETS.items()}
    final = stages(dockerfile)[-1]
    copies = [a.split() for i, a in final if i == "COPY" and a.startswith("--from=jars ")]
    assert copies == [["--from=jars", *(f"/jars/{folder}/" for folder in SETS), "/opt/spark/jars/"]]


def test_the_image_is_the_locked_spark(dockerfile):
    lock = locked(ROOT / "requirements.lock")
    (arg,) = [a for i, a in stages(dockerfile)[0] if i == "ARG" and a.startswith("SPARK_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert image.startswith(f"apache/spark:{lock['pyspark']}-"), image
    assert stages(dockerfile)[-1][0] == ("FROM", "${SPARK_IMAGE}")


def pins(dockerfile: str) -> dict[str, str]:
    runs = " ".join(a for s in stages(dockerfile) for i, a in s if i == "RUN")
    return {canonicalize_name(n): v for n, v in re.findall(r"(?<![\w=-])([A-Za-z][\w.-]*)==([\w.]+)", runs)}


def test_the_python_packages_are_the_locks(dockerfile):
    """Every pinned package at requirements.lock's version, the lock as constraints for their
    dependencies; pyarrow and numpy for the executors, the core requirements and Delta's two
    Python APIs for the driver (which runs in the same image in cluster mode)."""
    lock = locked(ROOT / "requirements.lock")
    got = pins(dockerfile)
    assert got and {n: lock.get(n) for n in got} == got
    core = {canonicalize_name(r.name) for r in requirements(pyproject(), [])[""]}
    assert {"pyarrow", "numpy", "deltalake", "delta-spark"} | core <= set(got)
    assert "pyspark" not in got  # the image's own Spark
    final = stages(dockerfile)[-1]
    assert ("COPY", "requirements.lock /tmp/requirements.lock") in final
    assert "-c /tmp/requirements.lock" in " ".join(a for i, a in final if i == "RUN")


def test_the_image_python_and_uv_are_the_projects(dockerfile):
    final = stages(dockerfile)[-1]
    python = re.search(r"uv venv --python (3\.\d+) ", " ".join(a for i, a in final if i == "RUN")).group(1)
    assert f"Programming Language :: Python :: {python}" in pyproject()["classifiers"]
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^PY \?= python(\S+)$", make, re.MULTILINE).group(1) == python  # the lock's Python
    uv = re.search(r"^UV_VERSION := (\S+)$", make, re.MULTILINE).group(1)
    assert f"COPY --from=ghcr.io/astral-sh/uv:{uv} /uv /usr/local/bin/uv" in [f"{i} {a}" for i, a in final]


def test_the_build_context_is_what_the_image_copies(dockerfile):
    """Dockerfile.dockerignore lets through the files the Dockerfile copies from the context
    (the repository root) and nothing else."""
    ignore = [ln.strip() for ln in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    kept = {ln[1:] for ln in ignore[1:] if ln.startswith("!")}
    copied = {src for s in stages(dockerfile) for i, a in s if i == "COPY" and not a.startswith("--from")
              for src in a.split()[:-1]}
    assert kept == copied
