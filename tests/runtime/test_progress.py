"""A job's progress lines and bar (pipelines/runtime/progress.py), without Spark."""

from __future__ import annotations

import io
import re
import time

import pytest

from userwise.pipelines.runtime import progress

LINE = re.compile(r"^\[userwise\] (\S+)\s+([\d,]+) rows\s+(\d+\.\d) s$")


@pytest.fixture(autouse=True)
def _loud(monkeypatch):
    monkeypatch.setattr(progress, "QUIET", False)


def test_a_step_prints_one_line_with_its_rows_and_seconds(capsys):
    with progress.step("requests") as st:
        time.sleep(0.1)
        st.rows = 1234567
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    m = LINE.match(err[0])
    assert m and m.group(1) == "requests" and m.group(2) == "1,234,567" and float(m.group(3)) >= 0.1, err


def test_a_failed_step_prints_no_line_and_quiet_prints_none(capsys, monkeypatch):
    with pytest.raises(ZeroDivisionError), progress.step("samples"):
        1 / 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "QUIET", True)
    with progress.step("samples") as st:
        st.rows = 3
    progress.say("anything")
    assert capsys.readouterr().err == ""


def test_rows_of_a_step_come_from_its_counter(capsys):
    """A step without its own count prints its counter's rows (made before the block runs)."""
    class Counter:
        def rows(self):
            return 42

    with progress.step("events", Counter()):
        pass
    assert LINE.match(capsys.readouterr().err.strip()).group(2) == "42"


def test_commits_count_the_rows_of_the_delta_commits_added_since_it_was_made(tmp_path):
    """``delta_io.commits``: numOutputRows of the commits made after it, from the table's log."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from userwise.pipelines.runtime import delta_io

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_deltalake(a, pa.table({"x": list(range(5))}))
    counter = delta_io.commits(a, b)  # b does not exist yet
    write_deltalake(a, pa.table({"x": list(range(10))}), mode="append")
    write_deltalake(b, pa.table({"x": list(range(32))}))
    assert counter.rows() == 42
    assert delta_io.commits(a, b).rows() == 0


def test_the_bar_draws_the_active_stages_tasks_on_a_terminal_and_clears_itself(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(progress, "BAR_AFTER_S", 0.0)
    monkeypatch.setattr(progress, "BAR_EVERY_S", 0.01)
    polls = iter([(0, 8, 1), (4, 8, 1), (4, 8, 1)] + [(8, 8, 2)] * 1000)
    monkeypatch.setattr(progress, "_stack", ["samples"])
    bar = progress._Bar(time.monotonic(), stream=tty, poll=lambda: next(polls))
    bar.start()
    time.sleep(0.3)
    bar.stop()
    out = tty.getvalue()
    frames = [f for f in out.split("\r") if f]
    assert frames[0].startswith("[userwise] samples     [" + "." * 24 + "] 0/8 tasks (1 stage)")
    assert any("[" + "#" * 12 + "." * 12 + "] 4/8 tasks" in f for f in frames)
    assert any("8/8 tasks (2 stages)" in f for f in frames)
    assert len(frames) < 10  # redrawn when it changes, not every poll
    assert out.endswith("\r\x1b[K")  # the line is cleared for the step's own line


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress, "BAR_AFTER_S", 0.0)
    monkeypatch.setattr(progress, "BAR_EVERY_S", 0.01)
    monkeypatch.setattr(progress, "spark_tasks", lambda: pytest.fail("polled Spark without a terminal"))
    with progress.step("history") as st:
        time.sleep(0.05)
        st.rows = 1
    assert "\r" not in capsys.readouterr().err


def test_spark_tasks_reads_the_active_stages_from_spark_s_status_tracker(spark):
    """Polled from another thread while a job of 40 tasks runs (each sleeps 0.1 s in the JVM)."""
    import threading

    job = threading.Thread(target=lambda: spark.range(40, numPartitions=40).selectExpr(
        "reflect('java.lang.Thread', 'sleep', cast(100 as bigint)) AS x").collect())
    job.start()
    seen = []
    while job.is_alive():
        got = progress.spark_tasks()
        if got and got[1]:
            seen.append(got)
        time.sleep(0.05)
    job.join()
    assert seen and all(total == 40 and stages == 1 and 0 <= done <= 40 for done, total, stages in seen), seen
    assert progress.spark_tasks() == (0, 0, 0)
