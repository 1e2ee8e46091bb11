"""Reading a user's input log: with Arrow (``validate``: no JVM) and with Spark (the build).

``--input`` takes one input or a comma-separated list of them, each of them:

- a Delta table (its folder); ``<table>@v<N>`` reads version N (``--input-version N``
  adds the suffix to every input);
- a Parquet file;
- a folder of Parquet files, hive-partitioned (``date=2026-01-01/...``) or not; a
  partition column may also sit inside the files;
- a glob of any of these (``logs/2026-*``, ``logs/*.parquet``).

Paths are local or any URL Spark reads (``validate`` reads them with pyarrow, and
expands remote globs with fsspec). Files and folders whose names start with ``_`` or
``.`` are not data (Spark's convention: ``_SUCCESS``, ``.crc``). Every input of a list
must have the same columns.

Both readers give the same columns, named and typed as the input's own schema
(:func:`input_schema`: dictionaries decoded, hive partition values typed as Spark
infers them). The Spark frame names them by their storage names
(``schemas.layout.storage_name``), each carrying its input type in its metadata,
plus ``_file`` and ``_row``: the input file and the row's index in it, which the
quarantine records and the build orders rows of a request by.
"""

from __future__ import annotations

import base64
import datetime as dt
import glob as globmod
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.dataset as ds

from userwise.pipelines.errors import FileSystemUnavailable, InputError
from userwise.schemas.layout import storage_name

SOURCE_FIELD = "userwise.source_field"  # Spark column metadata: the input's Arrow field (base64 IPC)
_VERSION = re.compile(r"^(.*)@v(\d+)$")


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # delta | file | folder
    version: int | None = None


# ---------------------------------------------------------------------------
# resolving --input
# ---------------------------------------------------------------------------
def _remote(path: str) -> bool:
    return "://" in path and not path.startswith("file:")


def _local(path: str) -> str:
    if path.startswith("file://"):
        return unquote(path[len("file://"):])
    if path.startswith("file:"):
        return unquote(path[len("file:"):])
    return path


def _fs(path: str):
    """(pyarrow filesystem, path within it)."""
    import pyarrow.fs as pafs

    if not _remote(path):
        return pafs.LocalFileSystem(), os.path.abspath(_local(path))
    from userwise.pipelines.runtime import storage

    try:
        return storage.filesystem(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise FileSystemUnavailable(f"input {path!r}: pyarrow cannot open its file system ({e}); the build "
                                    "reads it through Spark, validate needs a file system pyarrow reads") from None


def _kind(path: str) -> str | None:
    import pyarrow.fs as pafs

    fs, p = _fs(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type == pafs.FileType.File:
        return "file"
    if fs.get_file_info(p.rstrip("/") + "/_delta_log").type == pafs.FileType.Directory:
        return "delta"
    return "folder"


def _hidden(path: str) -> bool:
    return os.path.basename(path.rstrip("/")).startswith(("_", "."))


def _glob(pattern: str) -> list[str]:
    if _remote(pattern):
        from userwise.pipelines.runtime import storage

        try:
            hits = storage.glob(pattern)
        except (ImportError, ValueError, OSError) as e:
            raise InputError(f"input {pattern!r}: cannot expand the glob ({e})") from None
    else:
        hits = globmod.glob(_local(pattern))
    return sorted(h for h in hits if not _hidden(h))


def resolve(spec: str) -> list[Source]:
    """The inputs named by ``--input`` (see the module docstring), each checked to exist."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise InputError("--input names no input")
    out = []
    for part in parts:
        version = None
        m = _VERSION.match(part)
        if m and _kind(part) is None:
            part, version = m.group(1), int(m.group(2))
        if any(ch in part for ch in "*?[") and _kind(part) is None:
            paths = _glob(part)
            if not paths:
                raise InputError(f"input {part!r} matches no file or folder")
        else:
            paths = [part]
        for p in paths:
            kind = _kind(p)
            if kind is None:
                raise InputError(f"input {p!r} does not exist")
            if version is not None and kind != "delta":
                raise InputError(f"input {p!r} is not a Delta table: a version (@v{version}, --input-version) "
                                 "reads a Delta table as of that version")
            out.append(Source(p, kind, version))
    return out


def with_version(spec: str, version: int) -> str:
    """``spec`` with every input read at Delta ``version`` (``--input-version``)."""
    if version < 0:
        raise InputError(f"--input-version {version} must be >= 0")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    return ",".join(f"{p}@v{int(version)}" for p in parts)


# ---------------------------------------------------------------------------
# Arrow (validate)
# ---------------------------------------------------------------------------
def _partition_type(values: list[str]) -> pa.DataType:
    """The type Spark infers for a hive partition column from its values."""
    vals = [v for v in values if v != "__HIVE_DEFAULT_PARTITION__"]
    if not vals:
        return pa.string()
    try:
        ints = [int(v) for v in vals]
        return pa.int32() if all(-2**31 <= i < 2**31 for i in ints) else pa.int64()
    except ValueError:
        pass
    try:
        [float(v) for v in vals]
        return pa.float64()
    except ValueError:
        pass
    try:
        [dt.date.fromisoformat(v) for v in vals if len(v) == 10]
        if all(len(v) == 10 for v in vals):
            return pa.date32()
    except ValueError:
        pass
    return pa.string()


def _folder_dataset(path: str) -> ds.Dataset:
    fs, root = _fs(path)
    try:
        plain = ds.dataset(root, format="parquet", filesystem=fs, exclude_invalid_files=False,
                           ignore_prefixes=["_", "."])
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"input {path!r} is neither a Delta table nor Parquet: {e}") from None
    if not plain.files:
        raise InputError(f"input {path!r} holds no Parquet files")
    # hive partition keys in the paths, in path order, with their values
    keys: dict[str, list[str]] = {}
    for f in plain.files:
        rel = os.path.relpath(f, root) if not _remote(path) else f[len(root):].lstrip("/")
        for seg in rel.split("/")[:-1]:
            if "=" in seg:
                k, v = seg.split("=", 1)
                keys.setdefault(unquote(k), []).append(unquote(v))
    new = [k for k in keys if k not in plain.schema.names]
    if not new:  # no partitions, or partition columns that the files hold as well
        return plain
    part = ds.partitioning(pa.schema([pa.field(k, _partition_type(keys[k])) for k in new]), flavor="hive")
    try:
        return ds.dataset(root, format="parquet", filesystem=fs, partitioning=part, ignore_prefixes=["_", "."])
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"input {path!r}: cannot read its partitions ({e})") from None


def _delta_dataset(src: Source) -> ds.Dataset:
    from deltalake import DeltaTable as RsTable

    from userwise.pipelines.runtime.delta_io import arrow_filesystem

    try:
        t = RsTable(src.path, version=src.version)
    except Exception as e:  # noqa: BLE001 (delta-rs raises its own error types)
        raise InputError(f"input {src.path!r}: cannot read the Delta table"
                         f"{'' if src.version is None else f' at version {src.version}'} ({str(e).splitlines()[0]})"
                         ) from None
    return t.to_pyarrow_dataset(filesystem=arrow_filesystem(src.path))


def _source_dataset(src: Source) -> ds.Dataset:
    if src.kind == "delta":
        return _delta_dataset(src)
    if src.kind == "file":
        fs, p = _fs(src.path)
        try:
            return ds.dataset(p, format="parquet", filesystem=fs)
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"input {src.path!r} is not a Parquet file: {e}") from None
    return _folder_dataset(src.path)


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    """Dictionaries decoded (a hive partition read as a dictionary is its values)."""
    return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type, f.nullable)
                      for f in schema])


def arrow_dataset(spec: str) -> ds.Dataset:
    """The input as one Arrow dataset (Delta through delta-rs, Parquet through pyarrow)."""
    srcs = resolve(spec)
    sets = [_source_dataset(s) for s in srcs]
    if len(sets) == 1:
        return sets[0]
    first = _plain_schema(sets[0].schema).remove_metadata()
    for s, d in zip(srcs[1:], sets[1:]):
        sch = _plain_schema(d.schema).remove_metadata()
        if sch != first:
            diff = sorted(set(map(str, sch)) ^ set(map(str, first)))
            raise InputError(f"input {s.path!r} has other columns than {srcs[0].path!r} ({'; '.join(diff)[:300]}): "
                             "every input of a list must have the same columns")
    return ds.dataset([d.replace_schema(first) if d.schema != first else d for d in sets])


def input_schema(spec: str) -> pa.Schema:
    """The input's own schema: what a reader of the input sees as its columns."""
    return _plain_schema(arrow_dataset(spec).schema).remove_metadata()


# ---------------------------------------------------------------------------
# Spark (the build)
# ---------------------------------------------------------------------------
def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _has_nanos(t: pa.DataType) -> bool:
    if pa.types.is_timestamp(t):
        return t.unit == "ns"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_nanos(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_nanos(f.type) for f in t)
    return False


def _delta_frame(spark, src: Source):
    """A Delta table with its file and row index: Spark's Delta scan where it offers
    ``_metadata.row_index`` (tables with deletion vectors), else the table's files at the
    version, listed from its log by delta-rs and read as Parquet (exact without deletion
    vectors; partition values from the files' hive paths, typed by the table's schema)."""
    from pyspark.sql import functions as F

    r = spark.read.format("delta")
    if src.version is not None:
        r = r.option("versionAsOf", int(src.version))
    df = r.load(src.path)
    meta = df.select("_metadata").schema["_metadata"].dataType.fieldNames()
    if "row_index" in meta:
        return df.select("*", F.col("_metadata.file_path").alias("_file"), F.col("_metadata.row_index").alias("_row"))
    files = None
    try:
        from deltalake import DeltaTable as RsTable

        t = RsTable(src.path, version=src.version)
        parts = t.metadata().partition_columns
        mapped = t.metadata().configuration.get("delta.columnMapping.mode", "none") != "none"
        uris = t.file_uris()
        root = (src.path if _remote(src.path) else os.path.abspath(_local(src.path))).rstrip("/")
        rel = [u[len(root) + 1:] if u.startswith(root) else u for u in uris]
        if uris and not mapped and all(all(f"{p}=" in r_ for p in parts) for r_ in rel):
            files = uris
    except Exception:  # noqa: BLE001 (a table delta-rs cannot read: Spark's scan below)
        files = None
    if files:
        x = spark.read.schema(df.schema).option("basePath", root).parquet(*files)
        return x.select(*[F.col(_q(c)) for c in df.columns], F.col("_metadata.file_path").alias("_file"),
                        F.col("_metadata.row_index").alias("_row"))
    # column mapping or unusual paths: the file is known, the row's index is not (an
    # increasing id keeps the rows of a file in order)
    return df.select("*", F.col("_metadata.file_path").alias("_file"),
                     F.monotonically_increasing_id().alias("_row"))


def _source_frame(spark, src: Source):
    from pyspark.sql import functions as F

    if src.kind == "delta":
        return _delta_frame(spark, src)
    r = spark.read
    if src.kind == "folder":
        r = r.option("basePath", src.path)
    df = r.parquet(src.path)
    return df.select("*", F.col("_metadata.file_path").alias("_file"), F.col("_metadata.row_index").alias("_row"))


def _union(frames: list, spec: str):
    """The frames of a list or glob of inputs as one table (by column name), or one error line."""
    from pyspark.sql.utils import AnalysisException

    df = frames[0]
    for f in frames[1:]:
        try:
            df = df.unionByName(f)
        except AnalysisException as e:
            raise InputError(f"the inputs of {spec!r} cannot be read as one table: {str(e).splitlines()[0]}") from None
    return df


def read_spark(spark, spec: str, with_row_ids: bool = True):
    """The input as a Spark DataFrame: its columns in input order under their storage
    names (each with its input type in the column's metadata), plus ``_file`` and ``_row``."""
    from pyspark.sql import functions as F

    from userwise.pipelines.config import check_types

    try:
        srcs = resolve(spec)
        source = input_schema(spec)
    except FileSystemUnavailable:
        return _read_hadoop(spark, spec, with_row_ids)
    check_types(source)  # before Spark meets a type it cannot read (validate's own error)
    if any(_has_nanos(f.type) for f in source):
        spark.conf.set("spark.sql.legacy.parquet.nanosAsLong", "true")
    frames = []
    for s in srcs:
        f = _source_frame(spark, s)
        missing = [c for c in source.names if c not in f.columns]
        if missing:
            raise InputError(f"input {s.path!r}: Spark does not read columns {missing}")
        frames.append(f.select(*[F.col(_q(c)).alias(storage_name(c)) for c in source.names], "_file", "_row"))
    df = _union(frames, spec)
    cols = []
    for f in source:
        b64 = base64.b64encode(pa.schema([f]).serialize().to_pybytes()).decode()
        cols.append(F.col(_q(storage_name(f.name))).alias(storage_name(f.name), metadata={SOURCE_FIELD: b64}))
    if with_row_ids:
        cols += [F.col("_file"), F.col("_row")]
    return df.select(*cols)


def _read_hadoop(spark, spec: str, with_row_ids: bool):
    """:func:`read_spark` for inputs on a file system only Spark reads: resolved through
    Hadoop's file systems, typed as Spark reads them."""
    from pyspark.sql import functions as F
    from pyspark.sql.utils import AnalysisException

    jvm, conf = spark._jvm, spark._jsc.hadoopConfiguration()

    def status(p: str):
        jp = jvm.org.apache.hadoop.fs.Path(p)
        fs = jp.getFileSystem(conf)
        return fs.getFileStatus(jp) if fs.exists(jp) else None

    frames = []
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        version = None
        m = _VERSION.match(part)
        if m and status(part) is None:
            part, version = m.group(1), int(m.group(2))
        glob = any(ch in part for ch in "*?[")
        st = None if glob else status(part)
        if not glob and st is None:
            raise InputError(f"input {part!r} does not exist")
        try:
            if st is not None and st.isDirectory() and status(part.rstrip("/") + "/_delta_log") is not None:
                df = _delta_frame(spark, Source(part, "delta", version))
            elif version is not None:
                raise InputError(f"input {part!r} is not a Delta table: a version (@v{version}, --input-version) "
                                 "reads a Delta table as of that version")
            else:
                r = spark.read.option("basePath", part) if st is not None and st.isDirectory() else spark.read
                df = r.parquet(part)
                df = df.select("*", F.col("_metadata.file_path").alias("_file"),
                               F.col("_metadata.row_index").alias("_row"))
        except AnalysisException as e:
            raise InputError(f"input {part!r}: {str(e).splitlines()[0]}") from None
        cols = [c for c in df.columns if c not in ("_file", "_row")]
        frames.append(df.select(*[F.col(_q(c)).alias(storage_name(c)) for c in cols], "_file", "_row"))
    df = _union(frames, spec)
    return df if with_row_ids else df.drop("_file", "_row")


def source_field(spark_field) -> pa.Field | None:
    """The input's Arrow field recorded on a column of :func:`read_spark`'s frame."""
    b64 = (spark_field.metadata or {}).get(SOURCE_FIELD)
    if not b64:
        return None
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(b64))).field(0)
