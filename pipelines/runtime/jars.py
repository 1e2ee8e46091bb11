"""Delta's jars: resolve them once into a local cache, then point spark.jars there.

Order of attempts (``userwise jars``, run by ``make``):
1. the cache already holds them (checked by name and size): done;
2. Spark's own package resolution (Ivy) into the cache;
3. Maven (``mvn dependency:copy-dependencies``) with the pinned pom
   ``delta-jars.xml``.

Why 4.4.0: PyPI's delta-spark 4.4.1 is the Python API; Maven Central serves
the Spark 4.2 build of the jar (delta-spark_4.2_2.13) at 4.4.0, and the 4.4.x
Python API drives it unchanged.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DELTA_VERSION = "4.4.0"
DELTA_PACKAGES = (
    f"io.delta:delta-spark_4.2_2.13:{DELTA_VERSION}",
    f"io.delta:delta-storage:{DELTA_VERSION}",
)
JAR_NAMES = (f"delta-spark_4.2_2.13-{DELTA_VERSION}.jar", f"delta-storage-{DELTA_VERSION}.jar")


class JarsError(RuntimeError):
    pass


def cache_dir() -> Path:
    env = os.environ.get("USERWISE_JARS")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "userwise" / "jars"


def cached_jars() -> list[str] | None:
    d = cache_dir()
    paths = [d / n for n in JAR_NAMES]
    if all(p.exists() and p.stat().st_size > 0 for p in paths):
        return [str(p) for p in paths]
    return None


def _via_ivy(dest: Path, log) -> bool:
    """Spark's own resolution: spark-submit --packages on a no-op program."""
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    ivy = Path(tempfile.mkdtemp(prefix="userwise-ivy-"))
    noop = ivy / "noop.py"
    noop.write_text("pass\n")
    cmd = [str(submit), "--conf", f"spark.jars.ivy={ivy}", "--packages", ",".join(DELTA_PACKAGES), str(noop)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"spark package resolution failed: {e}")
        return False
    found = {Path(p).name: p for p in glob.glob(str(ivy / "jars" / "*.jar"))}
    want = {n: next((p for k, p in found.items() if k.endswith(n.split("-")[0] + "-" + DELTA_VERSION + ".jar")
                     or k.endswith(n)), None) for n in JAR_NAMES}
    if r.returncode != 0 or not all(want.values()):
        log("spark package resolution could not fetch Delta's jars; falling back to Maven")
        return False
    for n, p in want.items():
        shutil.copy(p, dest / n)
    return True


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


def _via_maven(dest: Path, log) -> bool:
    return maven_copy(Path(__file__).with_name("delta-jars.xml"), dest, log)


def ensure(verbose: bool = True, try_ivy: bool = True) -> list[str]:
    """Return the Delta jar paths, fetching them into the cache if needed."""
    got = cached_jars()
    if got:
        return got
    log = (lambda m: print(f"[jars] {m}", file=sys.stderr)) if verbose else (lambda m: None)
    dest = cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    log(f"fetching Delta {DELTA_VERSION} jars into {dest}")
    if (try_ivy and _via_ivy(dest, log)) or _via_maven(dest, log):
        got = cached_jars()
        if got:
            log("ok: " + ", ".join(got))
            return got
    raise JarsError(
        f"could not fetch Delta's jars ({', '.join(DELTA_PACKAGES)}); put {', '.join(JAR_NAMES)} "
        f"into {dest} (or set USERWISE_JARS to a folder holding them)"
    )


def cli(args) -> int:
    try:
        for p in ensure(verbose=True):
            print(p)
    except JarsError as e:
        from userwise.pipelines.errors import UserwiseError

        raise UserwiseError(str(e)) from None
    return 0
