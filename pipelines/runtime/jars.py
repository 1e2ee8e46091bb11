"""Jars the product needs beside pyspark: resolve a named set once into a local cache.

A :class:`JarSet` names Maven packages, the pinned pom beside this file that holds the
same versions, its folder in the cache and the files that must be there. :func:`fetch`
tries, in the set's order:
1. the cache already holds them (checked by name and size): done;
2. Spark's own package resolution (Ivy, ``spark-submit --packages`` on a no-op program);
3. Maven (``mvn dependency:copy-dependencies``) with the set's pom.

:data:`DELTA` is what every Spark session here loads (``userwise jars``, run by
``make``). Why 4.4.0: PyPI's delta-spark 4.4.1 is the Python API; Maven Central serves
the Spark 4.2 build of the jar (delta-spark_4.2_2.13) at 4.4.0, and the 4.4.x Python API
drives it unchanged. The HDFS minicluster's set lives with its launcher
(``pipelines/tools/hdfs_store.py``). :data:`S3` is Spark's S3 connector (``s3a://``), for
the sessions that read or write S3: hadoop-aws and the AWS SDK modules it loads, not the
SDK's 686 MB bundle (``s3-jars.xml``; ``pipelines/tools/s3_store.py`` gives the settings).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from userwise.pipelines.errors import JarsError


@dataclass(frozen=True)
class JarSet:
    """A set of jars fetched together.

    ``packages``: Maven coordinates for Spark's resolver; ``pom``: the pinned pom's file name
    beside this module; ``folder``: its folder under :func:`cache_dir` ("" for the cache
    itself); ``needed``: the file names that must be there; ``whole_folder``: the class path
    is every jar of the folder (the packages' dependencies too), not only ``needed``;
    ``maven_first``: try Maven before Ivy; ``excludes``: ``group:artifact`` patterns (``*``
    for any artifact) Spark's resolver leaves out, as the pom's exclusions do for Maven.

    Example::

        fetch(JarSet("Delta 4.4.0", ("io.delta:delta-storage:4.4.0",), "delta-jars.xml", "",
                     ("delta-storage-4.4.0.jar",)))
    """

    name: str
    packages: tuple[str, ...]
    pom: str
    folder: str
    needed: tuple[str, ...]
    whole_folder: bool = False
    maven_first: bool = False
    excludes: tuple[str, ...] = ()

    def dest(self) -> Path:
        return cache_dir() / self.folder if self.folder else cache_dir()

    def cached(self) -> list[str] | None:
        """The jars' paths when every needed file is there, else None."""
        d = self.dest()
        if not all((d / n).is_file() and (d / n).stat().st_size > 0 for n in self.needed):
            return None
        if self.whole_folder:
            return sorted(str(p) for p in d.glob("*.jar"))
        return [str(d / n) for n in self.needed]


DELTA_VERSION = "4.4.0"
DELTA = JarSet(
    name=f"Delta {DELTA_VERSION}",
    packages=(f"io.delta:delta-spark_4.2_2.13:{DELTA_VERSION}", f"io.delta:delta-storage:{DELTA_VERSION}"),
    pom="delta-jars.xml",
    folder="",
    needed=(f"delta-spark_4.2_2.13-{DELTA_VERSION}.jar", f"delta-storage-{DELTA_VERSION}.jar"),
)


HADOOP_AWS_VERSION = "3.5.0"  # the Hadoop client pyspark 4.2 ships (pyspark/jars/hadoop-client-api-3.5.0.jar)
AWS_SDK_VERSION = "2.35.4"  # hadoop-project 3.5.0's aws-java-sdk-v2.version
_SDK_MODULES = ("s3", "s3-transfer-manager", "sts", "apache-client", "netty-nio-client")
S3 = JarSet(
    name=f"Spark's S3 connector (hadoop-aws {HADOOP_AWS_VERSION}, AWS SDK {AWS_SDK_VERSION} modules)",
    packages=(f"org.apache.hadoop:hadoop-aws:{HADOOP_AWS_VERSION}",
              *(f"software.amazon.awssdk:{m}:{AWS_SDK_VERSION}" for m in _SDK_MODULES)),
    pom="s3-jars.xml",
    folder=f"s3-{HADOOP_AWS_VERSION}",
    needed=(f"hadoop-aws-{HADOOP_AWS_VERSION}.jar", f"sdk-core-{AWS_SDK_VERSION}.jar",
            *(f"{m}-{AWS_SDK_VERSION}.jar" for m in _SDK_MODULES)),
    whole_folder=True,
    maven_first=True,
    # as s3-jars.xml: the bundle, and what pyspark's own jars folder already holds
    excludes=("software.amazon.awssdk:bundle", "org.wildfly.openssl:*", "io.netty:*",
              "org.apache.httpcomponents:*", "commons-codec:*", "commons-logging:*", "org.slf4j:*"),
)


def cache_dir() -> Path:
    env = os.environ.get("USERWISE_JARS")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "userwise" / "jars"


def for_paths(*paths: str | None) -> list[str] | None:
    """The cached jars a Spark job over ``paths`` loads: Delta's, and the S3 connector's when a
    path is on S3 (``s3://``, ``s3a://``, ``s3n://``); None when a set it needs is not cached."""
    from userwise.pipelines.runtime import storage

    got = DELTA.cached()
    if got and any(storage.is_s3(p) for p in paths):
        s3 = S3.cached()
        return got + s3 if s3 else None
    return got


def _via_ivy(js: JarSet, dest: Path, log) -> bool:
    """Spark's own resolution: spark-submit --packages on a no-op program."""
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    ivy = Path(tempfile.mkdtemp(prefix="userwise-ivy-"))
    try:
        noop = ivy / "noop.py"
        noop.write_text("pass\n")
        cmd = [str(submit), "--conf", f"spark.jars.ivy={ivy}", "--packages", ",".join(js.packages)]
        if js.excludes:
            cmd += ["--exclude-packages", ",".join(js.excludes)]
        cmd.append(str(noop))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"spark package resolution failed: {e}")
            return False
        # Ivy names them group_artifact-version.jar; the cache keeps artifact-version.jar
        found = {p.name.split("_", 1)[-1]: p for p in (ivy / "jars").glob("*.jar")}
        if r.returncode != 0 or not all(n in found for n in js.needed):
            log(f"spark package resolution could not fetch {js.name}")
            return False
        for n, p in found.items():
            if js.whole_folder or n in js.needed:
                shutil.copy(p, dest / n)
        return True
    finally:
        shutil.rmtree(ivy, ignore_errors=True)


def maven_copy(pom: Path, dest: Path, log) -> bool:
    """Copy the runtime dependencies pinned in ``pom`` into ``dest`` with Maven; False (logged) if it cannot."""
    mvn = shutil.which("mvn")
    if not mvn:
        log("mvn is not on PATH")
        return False
    cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
           f"-DoutputDirectory={dest}", "-DincludeScope=runtime"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log("maven failed:\n" + (r.stdout + r.stderr)[-2000:])
        return False
    return True


def _via_maven(js: JarSet, dest: Path, log) -> bool:
    return maven_copy(Path(__file__).with_name(js.pom), dest, log)


def fetch(js: JarSet, verbose: bool = True, try_ivy: bool = True) -> list[str]:
    """The set's jar paths, fetched into the cache if needed; :class:`JarsError` (one line) if they cannot be."""
    got = js.cached()
    if got:
        return got
    log = (lambda m: print(f"[jars] {m}", file=sys.stderr)) if verbose else (lambda m: None)
    dest = js.dest()
    dest.mkdir(parents=True, exist_ok=True)
    log(f"fetching {js.name} jars into {dest}")
    tries = [_via_maven] + ([_via_ivy] if try_ivy else [])
    if not js.maven_first:
        tries.reverse()
    for attempt in tries:
        if attempt(js, dest, log):
            got = js.cached()
            if got:
                log("ok: " + ", ".join(got))
                return got
    raise JarsError(
        f"could not fetch {js.name}'s jars ({', '.join(js.packages)}): no network to Maven Central? "
        f"Put {', '.join(js.needed)} into {dest} (or set USERWISE_JARS to a jar cache holding them)"
    )


def ensure(verbose: bool = True, try_ivy: bool = True) -> list[str]:
    """Return the Delta jar paths, fetching them into the cache if needed."""
    return fetch(DELTA, verbose=verbose, try_ivy=try_ivy)


def cli(args) -> int:
    """``userwise jars``: one jar path per line (what ``--jars`` takes, joined by commas), or
    with ``--json`` ``{"jars": [...]}``."""
    from userwise.pipelines import console

    paths = ensure(verbose=True)  # a JarsError is a UserwiseError: one error line
    console.emit({"jars": list(paths)}, lambda rep: "\n".join(rep["jars"]))
    return 0
