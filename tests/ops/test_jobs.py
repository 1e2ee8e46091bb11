"""The spark-submit entry points (jobs/*.py) as Python runs them: the script's folder first on
the import path. jobs/requests.py sits there, so every job must take that folder off before the
`requests` library is imported (WebHDFS, the object stores): else `import requests` finds the job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

JOBS = sorted((Path(__file__).resolve().parents[2] / "jobs").glob("*.py"))

# Python's own start for `python jobs/X.py`: the folder first on sys.path; the file's top level
# runs (not as __main__), then what a job's storage calls import.
PRELUDE = """
import sys
path = sys.argv[1]
sys.path.insert(0, path.rsplit("/", 1)[0])
exec(compile(open(path).read(), path, "exec"), {"__file__": path, "__name__": "job"})
import requests
print(requests.Session.__name__)
"""


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_a_job_does_not_shadow_the_requests_library(job):
    r = subprocess.run([sys.executable, "-c", PRELUDE, str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "Session", r.stderr[-2000:]


def test_the_check_sees_the_shadow(tmp_path):
    (tmp_path / "requests.py").write_text("")
    job = tmp_path / "job.py"
    job.write_text("import sys\n")
    r = subprocess.run([sys.executable, "-c", PRELUDE, str(job)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Session" in r.stderr
