"""The one place a SparkSession is made: local by default, any master by URL.

Local mode is the embedded default: Delta tables in a folder, few shuffle
partitions, UTC everywhere. Under spark-submit (YARN, Kubernetes, standalone)
the submitted configuration wins and we only add what is missing.
"""

from __future__ import annotations

import contextlib
import os
import sys

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.runtime import jars, progress

_LOCAL_DEFAULTS = {
    # 2x the cores of local[2]: measured side by side on the fat-row build at 450k rows,
    # 8 / 4 / 2 partitions took 49.3 / 46.6 / 45.1 s (two runs each); 4 keeps some slack
    # for a skewed task without the per-task overhead of 8.
    "spark.sql.shuffle.partitions": "4",
    # Delta rebuilds table state in this many tasks (default 50): far too many locally.
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.default.parallelism": "4",
    "spark.driver.memory": "4g",
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.adaptive.skewJoin.enabled": "true",
    "spark.ui.showConsoleProgress": "false",
    # One executor in the driver: no task has a better place to wait for. Reading HDFS, tasks
    # prefer the data node's host name, never the driver's; local mode offers cores again only
    # when a task ends, so a task set left waiting for locality once waits forever.
    "spark.locality.wait": "0s",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.databricks.delta.schema.autoMerge.enabled": "false",
    # The build caches the validated input once (ingest) and drops it after the three
    # tables are written: compressing that short-lived cache costs more CPU than the
    # memory it saves. Lean build at 1.1M impressions, two pairs alternating: 32.5 / 32.0 s
    # against 35.9 / 33.3 s compressed.
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    # Listing many folders (an input with a folder per day, Delta's VACUUM) runs a Spark job
    # of up to this many tasks (10,000 by default): VACUUM of a small table ran 170,000
    # empty tasks in 26 s, against 2.5 s with a few tasks per core.
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "8",
    # The parallel (throughput) collector instead of G1: a local build is a batch job on
    # few cores, where G1's concurrent work competes with the tasks. Fat-row build at 852k
    # rows, three pairs alternating: 41.8 / 38.0 / 40.3 s against 48.3 / 44.1 / 42.7 s with G1.
    "spark.driver.extraJavaOptions": "-Dlog4j2.level=warn -XX:+UseParallelGC",
}

_ALWAYS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    # Parquet row index and file path let the build name every input row.
    "spark.sql.parquet.enableVectorizedReader": "true",
    "spark.databricks.delta.retentionDurationCheck.enabled": "false",
}


# Settings from the command line (`--conf key=value`), applied last to every session made here.
CLI_CONF: dict[str, str] = {}

# Where the JVM's own log goes when this process starts it (None: the console, or not started here).
LOG_PATH: str | None = None

_LOG4J = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {path}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n
rootLogger.level = {level}
rootLogger.appenderRef.file.ref = file
"""


def _log_to_file() -> tuple[str, str]:
    """Write a log4j2 configuration that sends the driver's log to a file; return the file.

    The folder is ``$USERWISE_LOG_DIR`` (the user's choice, used as it is), else this user's
    private ``<tmp>/userwise-<uid>/logs`` (0700, owner checked: ``ship.private_tmp``).
    Both files are new: created with ``O_EXCL | O_NOFOLLOW``, so a link or file planted at
    their names is never written through (another name is taken). ``userwise --verbose``
    (``USERWISE_VERBOSE=1``) keeps Spark's console log instead.
    """
    import datetime as dt

    from userwise.pipelines.runtime import ship

    given = os.environ.get("USERWISE_LOG_DIR")
    if given:
        if not os.path.lexists(given):
            os.makedirs(given, exist_ok=True)
        if not os.path.isdir(given):
            raise UserwiseError(f"USERWISE_LOG_DIR={given}: not a folder; set it to a folder for Spark's log files")
    d = given or str(ship.private_tmp("logs"))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, fd = _create_new(d, f"spark-{stamp}-{os.getpid()}", ".log")
    os.close(fd)
    props, fd = _create_new(d, f"log4j2-{os.getpid()}", ".properties")
    with os.fdopen(fd, "w") as f:
        f.write(_LOG4J.format(path=path, level=os.environ.get("USERWISE_SPARK_LOG", "WARN").lower()))
    return path, props


def _create_new(folder: str, stem: str, suffix: str) -> tuple[str, int]:
    """A new file ``folder/stem[-n]suffix`` (the first name free) and its descriptor, opened for
    writing with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (mode 0600): never a file or link already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for n in range(100):
        path = os.path.join(folder, f"{stem}{f'-{n}' if n else ''}{suffix}")
        try:
            return path, os.open(path, flags, 0o600)
        except FileExistsError:
            continue
    raise UserwiseError(f"{folder}: {stem}{suffix} and 99 other names for Spark's log are taken; "
                        "remove old files there or set USERWISE_LOG_DIR to another folder")


def _launch_jvm_logging_to(path: str, builder) -> None:
    """Start the driver JVM with its stdout and stderr in ``path`` (the JVM's start-up
    warnings included), exactly as ``getOrCreate`` would start it otherwise."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:
        return
    conf = SparkConf()
    for k, v in builder._options.items():
        conf.set(k, v)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    with os.fdopen(fd, "ab") as log:
        gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
    SparkContext._ensure_initialized(gateway=gateway)


def get_spark(master: str | None = None, app: str = "userwise", ui: bool | None = None,
              conf: dict[str, str] | None = None):
    """Return the active session or make one.

    ``master=None`` means: whatever spark-submit set, else ``local[2]``. ``conf`` and the
    command line's ``--conf`` settings (:data:`CLI_CONF`) come last: they win.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    b = SparkSession.builder.appName(app)
    submitted = "SPARK_SUBMIT_OPTS" in os.environ or os.environ.get("SPARK_ENV_LOADED") == "1" or \
        bool(os.environ.get("PYSPARK_GATEWAY_PORT"))
    if master:
        b = b.master(master)
    elif not submitted:
        b = b.master(os.environ.get("USERWISE_SPARK_MASTER", "local[2]"))
    effective = master or ("" if submitted else os.environ.get("USERWISE_SPARK_MASTER", "local[2]"))
    local = not submitted and effective.startswith("local")
    cluster = not submitted and not local
    if cluster:
        refuse_unshippable(effective)
    settings = {**(conf or {}), **CLI_CONF}
    if not submitted and settings.get("spark.pyspark.python"):
        # spark-submit turns this setting into the executors' Python; a JVM started from here does
        # not, and PySpark takes it from PYSPARK_PYTHON alone (else `python3`)
        os.environ["PYSPARK_PYTHON"] = settings["spark.pyspark.python"]
    if local:
        # Python workers must run the interpreter that has our dependencies, not `python3`.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if not submitted:
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    global LOG_PATH
    java_opts = None
    if not submitted and os.environ.get("USERWISE_VERBOSE") != "1":
        LOG_PATH, props = _log_to_file()
        java_opts = f"-Dlog4j2.configurationFile=file:{props}"
    if local:
        for k, v in _LOCAL_DEFAULTS.items():
            if k == "spark.driver.extraJavaOptions" and java_opts:
                v = f"{v} {java_opts}"
            b = b.config(k, v)
    elif java_opts:
        b = b.config("spark.driver.extraJavaOptions", java_opts)
        b = b.config("spark.ui.enabled", "false" if ui is False else "true" if ui else "false")
    for k, v in _ALWAYS.items():
        b = b.config(k, v)
    if not submitted:
        # Under spark-submit the jars come with --jars/--packages; here we add them.
        b = b.config("spark.jars", ",".join(jars.ensure()))
    for k, v in settings.items():
        b = b.config(k, v)
    if LOG_PATH:
        _launch_jvm_logging_to(LOG_PATH, b)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("USERWISE_SPARK_LOG", "WARN"))
    if cluster:
        # A cluster's executors need not have userwise installed: the code this process runs
        # goes with the job (preshard's writer runs on them), as spark-submit --py-files would send it.
        from userwise.pipelines.runtime import ship

        spark.sparkContext.addPyFile(str(ship.installed_zip()))
    if LOG_PATH:
        progress.say(f"Spark's log: {LOG_PATH}")  # errors name it too, with --quiet as well
    return spark


# Masters a command reaches from this process in client mode, shipping the code itself.
SHIPS_ITSELF = ("spark://", "yarn", "mesos://")


def refuse_unshippable(master: str) -> None:
    """Refuse a master this process cannot drive as a client with the code shipped, naming the
    spark-submit command to use instead (Kubernetes: the driver runs in a pod, in cluster mode)."""
    if master.startswith(SHIPS_ITSELF):
        return
    argv = [a for a in sys.argv[1:] if a and not a.startswith("--master") and a != master]
    job = next((a for a in argv if not a.startswith("-")), "JOB")
    rest = " ".join(argv[argv.index(job) + 1:]) if job in argv else "ARGS"
    if master.startswith("k8s://"):
        raise UserwiseError(
            f"--master {master}: on Kubernetes the driver runs in a pod (cluster mode), which this command "
            "cannot start; build the zip with `userwise ship`, put dist/*-pyfiles.zip and jobs/ where the pods "
            f"read them, and run `spark-submit --master {master} --deploy-mode cluster "
            "--conf spark.kubernetes.container.image=IMAGE --py-files URL/userwise-pyfiles.zip "
            f"URL/jobs/{job}.py {rest}` with the image docker/spark/Dockerfile builds (Spark, the jars, the Python "
            "packages; docs/operations.md)")
    raise UserwiseError(f"--master {master}: not a Spark master this command drives; use local[K], "
                        "spark://host:port or yarn, or submit jobs/*.py with spark-submit (docs/operations.md)")


@contextlib.contextmanager
def session_conf(spark, conf: dict[str, str]):
    """Set session ``conf`` for the block, then put back what was there (unset what was not)."""
    before = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
