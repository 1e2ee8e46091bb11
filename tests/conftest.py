"""Shared fixtures: one local Spark session for the whole suite (the JVM starts once)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

# The JVMs the suite starts in subprocesses (each `userwise` command's driver, spark-submit and
# its launcher, the HDFS minicluster, the standalone cluster) run small jobs for under a minute,
# where the optimizing JIT compiler (C2) costs more CPU than it gains: the client compiler alone
# took a third less CPU. Two tiny builds side by side on two cores, two pairs alternating: 91 /
# 101 s against 144 / 134 s with both compilers. The suite's own Spark session (the fixture
# below) lives for the whole run and keeps C2: with C1 alone its modules took up to half as long
# again. Production runs keep the JVM's default. A JVM prints "Picked up JAVA_TOOL_OPTIONS" on
# its stderr: the CLI's driver writes that to its log file, and no test reads a JVM's raw stderr.
SHORT_JVM = "-XX:TieredStopAtLevel=1"
os.environ.setdefault("JAVA_TOOL_OPTIONS", SHORT_JVM)


# py4j logs at INFO from __del__ at interpreter exit, after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


def pytest_collection_modifyitems(items):
    """Every test that uses the Spark session carries the ``spark`` marker, so that
    ``-m "not spark"`` runs exactly the tests without a JVM."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from userwise.pipelines.runtime.spark import get_spark

    wh = tmp_path_factory.mktemp("warehouse")
    short = os.environ.get("JAVA_TOOL_OPTIONS") == SHORT_JVM
    if short:
        del os.environ["JAVA_TOOL_OPTIONS"]  # this JVM is long-lived: both compilers
    try:
        s = get_spark(
            master="local[2]",
            app="userwise-tests",
            ui=False,
            conf={
                "spark.sql.shuffle.partitions": "2",
                "spark.databricks.delta.snapshotPartitions": "1",
                "spark.default.parallelism": "2",
                "spark.sql.warehouse.dir": str(wh),
                "spark.driver.memory": "3g",
            },
        )
    finally:
        if short:
            os.environ["JAVA_TOOL_OPTIONS"] = SHORT_JVM
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _test_sized_shuffle_buffers(monkeypatch):
    """The tests' shard sets have row groups of 8-30 rows: at the product's target of 4096
    samples per buffer (buffer_row_groups="auto") every rank would read one buffer, and the
    tests of buffers split across workers, resumption across buffers and shuffles within
    buffers would lose their subject. Scaled to the tests' sizes, auto picks 2 row groups
    (the old default). test_loader.py::test_auto_buffer_size checks the real targets."""
    from userwise.pipelines.loader import dataset

    monkeypatch.setattr(dataset, "BUFFER_ROWS", 16)
