"""The shard set manifest: read, validate, write (atomically, last), verify.

The one implementation of the shard set contract: preshard and the synthetic
shard sets (``pipelines/tools/shardgen.py``) write through it, stage, publish
and the loader read and verify through it, and :func:`file_sha256` is the one
checksum of its files.

A shard set is ``S/node=<k>/shard-<NNNNN>.parquet`` (+ ``.gds``) and
``S/manifest.json``; without the manifest the set is incomplete and every
reader here refuses it. ``S`` is a local path or any URL that pyarrow.fs
(file, hdfs, s3, gs) or fsspec opens. No Spark here: ``stage`` and the loader
use this module.

Example::

    m = manifest.load("/nvme/shards")          # raises ShardError when missing or newer
    manifest.verify("/nvme/shards", node=0)    # sizes, checksums, schema, rows
    [s["path"] for s in manifest.node_shards(m, 0)]
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re

import pyarrow.fs as pafs

from userwise.pipelines.errors import ArgumentError, ShardError, expect, short
from userwise.schemas import MANIFEST_KEYS, MANIFEST_SHARD
from userwise.schemas.core import SchemaError, check_version, list_fingerprint, schema_fingerprint

MANIFEST = "manifest.json"
# Every documented key but the writer settings (compression, dictionary and row_group_rows
# are informational: a manifest without them still loads).
INFORMATIONAL = ("compression", "dictionary", "row_group_rows")
REQUIRED = tuple(k for k in MANIFEST_KEYS if k not in INFORMATIONAL)
CHUNK = 4 << 20
# How much of a shard's files a reader checks: size and sha256, size only, or that they exist.
VERIFY = ("checksum", "size", "none")


def resolve(root: str, fs=None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or a URL.

    ``fs`` may be a pyarrow or an fsspec filesystem; without it, ``root`` opens as
    ``pipelines/runtime/storage.py`` says (``hdfs://`` through libhdfs or WebHDFS, other URLs
    through pyarrow, else fsspec).
    """
    if fs is not None:
        if not isinstance(fs, pafs.FileSystem):
            fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
        return fs, root.rstrip("/") or "/"
    from userwise.pipelines.runtime import storage

    try:
        return storage.filesystem(root)
    except storage.StorageError as e:
        raise ShardError(str(e)) from None


def join(base: str, rel: str) -> str:
    return posixpath.join(base, rel) if "/" in base else os.path.join(base, rel)


def hash_stream(src, h=None) -> tuple:
    """Feed a binary stream to its end into ``h`` (default a new sha256); return (h, bytes read).

    ``stage`` hashes a partial copy with it before it continues the copy."""
    h = hashlib.sha256() if h is None else h
    n = 0
    while b := src.read(CHUNK):
        h.update(b)
        n += len(b)
    return h, n


def file_sha256(path: str, fs=None) -> str:
    """sha256 of a file's bytes (hex), streamed: the shard format's one checksum.

    ``path``: a local path, or a path inside ``fs`` (a pyarrow or fsspec filesystem)."""
    if fs is None and "://" not in path:
        with open(path, "rb") as src:
            return hash_stream(src)[0].hexdigest()
    f, p = resolve(path, fs)
    with f.open_input_stream(p) as src:
        return hash_stream(src)[0].hexdigest()


def _exists(f: pafs.FileSystem, p: str) -> bool:
    return f.get_file_info(p).type == pafs.FileType.File


def load(root: str, fs=None) -> dict:
    """Read and validate ``root/manifest.json``; raise ShardError naming the path."""
    f, base = resolve(root, fs)
    path = join(base, MANIFEST)
    if not _exists(f, path):
        raise ShardError(f"{path}: no manifest; the shard set is incomplete (preshard or stage did not "
                         "finish) or this is not a shard set root: rerun `userwise preshard` or `userwise stage`")
    try:
        with f.open_input_stream(path) as src:
            m = json.loads(src.read().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: not valid JSON ({e}); rerun `userwise preshard`") from None
    return validate(m, path)


# Names a shard set's folders hold for stage and the manifest themselves, never a shard's: the
# stage lock, the manifest (and its temporary name), a copy under way and its finished ranges.
RESERVED = (".stage.lock", MANIFEST)
RESERVED_SUFFIXES = (".part", ".part.ranges", ".part.ranges.tmp")


def safe_relpath(path, where: str) -> str:
    """``path`` when it is a safe relative path inside a shard set's root, else ShardError.

    Safe: a non-empty string of ``/``-separated names, relative (no leading ``/``, no drive, no
    scheme such as ``s3://`` or ``file:``), normalised (no ``.``, ``..`` or empty name, no
    ``\\``), with no control character, and no part named as stage's own files (:data:`RESERVED`, or
    ending in one of :data:`RESERVED_SUFFIXES`). A manifest is written by whoever can write the
    cluster storage, so stage and the loader check every path it holds before they touch anything;
    ``where`` names the entry in the error."""
    if not isinstance(path, str) or not path:
        raise ShardError(f"{where}: a path must be a non-empty string, got {short(path)}; the manifest was edited "
                         "or damaged: rerun `userwise preshard`")
    parts = path.split("/")
    why = None
    if path.startswith("/") or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        why = "is absolute or has a scheme"
    elif "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        why = "holds a backslash or a control character"
    elif any(p in ("", ".", "..") for p in parts):
        why = "is not normalised (an empty, '.' or '..' part)"
    elif any(p in RESERVED or p.startswith(f".{MANIFEST}.tmp-") or p.endswith(RESERVED_SUFFIXES) for p in parts):
        why = ("uses a name that stage and the manifest keep for themselves (.stage.lock, manifest.json, "
               "*.part, *.part.ranges)")
    if why:
        raise ShardError(f"{where}: path {short(path)} {why}; a shard set's paths are relative to its root, "
                         "e.g. node=0/shard-00000.parquet: the manifest was edited or damaged, refused before "
                         "anything was read or written")
    return path


_FIX = "the manifest was edited or damaged: rerun `userwise preshard`"
# The most rows a manifest may say one shard holds: far above any shard preshard writes (a few hundred
# MiB each), and low enough that no count or offset derived from it overflows an int64.
MAX_SHARD_ROWS = 1 << 40


def _typed(d: dict, key: str, kind: str, where: str, *, nullable: bool = False):
    """``d[key]`` checked against ``kind`` (:func:`~userwise.pipelines.errors.expect`)."""
    if key not in d:
        raise ShardError(f"{where}: field {key!r} is missing; rerun `userwise preshard`")
    return expect(d[key], kind, f"{where}: field {key!r}", nullable=nullable, error=ShardError, fix=_FIX)


_SHA = re.compile(r"^[0-9a-f]{64}$")
# The manifest's own schema: every field a reader uses, with its type (MANIFEST_SHARD's fields, by kind).
_TOP = {"format_version": "int", "nodes": "int>=1", "ranks_per_node": "int>=1", "seed": "int", "layout": "str",
        "schema_fingerprint": "str", "schema": "list", "roles": "dict", "source": "dict", "sets": "list",
        "shards": "list"}
_SET = {"id": "str", "kind": "str", "rows": "int>=0", "cost": "int>=0", "shards_per_rank": "int>=0"}
_SHARD = {"path": "str", "node": "int>=0", "rank": "int>=0", "rows": "int>=0", "events": "int>=0",
          "impressions": "int>=0", "cost": "int>=0", "bytes": "int>=0", "row_groups": "int>=0", "sha256": "str",
          "set": "str"}


def validate(m: dict, where: str = MANIFEST) -> dict:
    """Check a manifest's schema (every field a reader uses, with its type) and its paths
    (:func:`safe_relpath`); raise ShardError naming the entry and the field."""
    if not isinstance(m, dict):
        raise ShardError(f"{where}: a manifest is a JSON object")
    try:
        check_version(m.get("format_version"), where)
    except SchemaError as e:
        raise ShardError(str(e)) from None
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise ShardError(f"{where}: manifest lacks {missing}; rerun `userwise preshard`")
    for k, kind in _TOP.items():
        _typed(m, k, kind, where)
    # the shape, bounded by the data before anything sized by it is made: preshard writes every set's
    # shards for every rank of every node (empty ones included), so a set has a shard per rank
    slots, listed = m["nodes"] * m["ranks_per_node"], len(m["shards"])
    if slots > max(1, listed):
        raise ShardError(f"{where}: 'nodes' x 'ranks_per_node' = {m['nodes']} x {m['ranks_per_node']} ranks, but "
                         f"only {listed} shards are listed (preshard lists a shard of every set for every rank); {_FIX}")
    if not all(isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], str)
               for c in m["schema"]):
        raise ShardError(f"{where}: field 'schema' must be a list of [name, type, nullable]; the manifest was "
                         "edited or damaged: rerun `userwise preshard`")
    fp = schema_fingerprint_of(m["schema"])
    if fp != m["schema_fingerprint"]:
        raise ShardError(f"{where}: schema_fingerprint {m['schema_fingerprint']} does not match its "
                         f"schema ({fp}); the manifest was edited or damaged")
    if "staged_node" in m:
        _typed(m, "staged_node", "int>=0", where)
    for i, st in enumerate(m["sets"]):
        w = f"{where}: sets[{i}]"
        if not isinstance(st, dict):
            raise ShardError(f"{w} must be an object, got {short(st)}")
        for k, kind in _SET.items():
            _typed(st, k, kind, w)
    keys = set(MANIFEST_SHARD.names) | {"set"}
    sets = {s["id"] for s in m["sets"]}
    for i, s in enumerate(m["shards"]):
        w = f"{where}: shards[{i}]"
        if not isinstance(s, dict):
            raise ShardError(f"{w} must be an object, got {short(s)}")
        lack = keys - set(s)
        if lack:
            raise ShardError(f"{w} lacks {sorted(lack)}")
        for k, kind in _SHARD.items():
            _typed(s, k, kind, w)
        safe_relpath(s["path"], f"{w}.path")
        if not _SHA.match(s["sha256"]):
            raise ShardError(f"{w}: field 'sha256' must be 64 hex digits, got {short(s['sha256'])}")
        if s["node"] >= m["nodes"]:
            raise ShardError(f"{w}: node {s['node']} is outside the set's {m['nodes']} nodes")
        if s["rank"] >= m["ranks_per_node"]:
            raise ShardError(f"{w}: rank {s['rank']} is outside the set's {m['ranks_per_node']} ranks per node")
        if s["rows"] > MAX_SHARD_ROWS:
            raise ShardError(f"{w}: field 'rows' is {s['rows']}, more than a shard can hold ({MAX_SHARD_ROWS}); {_FIX}")
        if s.get("gds_path") is not None:
            safe_relpath(_typed(s, "gds_path", "str", w), f"{w}.gds_path")
            _typed(s, "gds_bytes", "int>=0", w)
            if not _SHA.match(_typed(s, "gds_sha256", "str", w)):
                raise ShardError(f"{w}: field 'gds_sha256' must be 64 hex digits, got {short(s['gds_sha256'])}")
        if s["set"] not in sets:
            raise ShardError(f"{w} ({s['path']}) belongs to set {s['set']!r}, which is not "
                             "listed in the manifest's sets; the manifest was edited or damaged")
    paths = [p for s in m["shards"] for p in (s["path"], s.get("gds_path")) if p is not None]
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ShardError(f"{where}: the path {short(dup)} is listed twice; the manifest was edited or damaged")
    rows = dict.fromkeys(sets, 0)
    for s in m["shards"]:
        rows[s["set"]] += s["rows"]
    for i, st in enumerate(m["sets"]):
        if st["rows"] != rows[st["id"]]:
            raise ShardError(f"{where}: sets[{i}]: field 'rows' is {st['rows']}, but its shards hold "
                             f"{rows[st['id']]} rows; {_FIX}")
    return m


def schema_fingerprint_of(schema: list) -> str:
    """The fingerprint of a manifest's ``schema`` list ([[name, type, nullable], ...])."""
    return list_fingerprint(schema)


def write(root: str, manifest: dict, fs=None) -> str:
    """Write ``root/manifest.json`` through a temporary name and a rename. Call it last."""
    validate(manifest, join(root, MANIFEST))
    f, base = resolve(root, fs)
    path = join(base, MANIFEST)
    tmp = join(base, f".{MANIFEST}.tmp-{os.getpid()}")
    data = (json.dumps(manifest, indent=1, sort_keys=False) + "\n").encode()
    with f.open_output_stream(tmp) as out:
        out.write(data)
    from userwise.pipelines.runtime import storage

    storage.replace(f, tmp, path)
    return path


def node_shards(manifest: dict, node: int) -> list[dict]:
    """The shards of one node, in set order (training order), then shard path."""
    if not 0 <= node < int(manifest["nodes"]):
        raise ShardError(f"node {node} is not in this shard set (nodes 0..{int(manifest['nodes']) - 1})")
    order = {s["id"]: i for i, s in enumerate(manifest["sets"])}
    out = [s for s in manifest["shards"] if int(s["node"]) == node]
    return sorted(out, key=lambda s: (order[s["set"]], s["path"]))


def shard_files(shard: dict) -> list[tuple[str, int, str]]:
    """(relative path, bytes, sha256) of the files of one manifest shard (Parquet, then .gds)."""
    out = [(shard["path"], int(shard["bytes"]), shard["sha256"])]
    if shard.get("gds_path"):
        out.append((shard["gds_path"], int(shard["gds_bytes"]), shard["gds_sha256"]))
    return out


def check_files(root: str, shard: dict, *, verify: str = "checksum", fs=None) -> tuple[int, int]:
    """The files of one manifest shard exist under ``root`` with their size and checksum.

    ``verify``: ``checksum`` (size and sha256), ``size``, or ``none`` (only that they exist).
    Returns (files, bytes); raises ShardError naming the first bad file."""
    if verify not in VERIFY:
        raise ArgumentError(f"verify must be one of {VERIFY}, got {verify!r}")
    f, base = resolve(root, fs)
    n = total = 0
    for rel, size, sha in shard_files(shard):
        p = join(base, rel)
        info = f.get_file_info(p)
        if info.type != pafs.FileType.File:
            raise ShardError(f"{p}: missing (listed in the manifest); copy the shard set again "
                             "(`userwise stage`) or rerun `userwise preshard`")
        if verify != "none" and info.size != size:
            raise ShardError(f"{p}: {info.size} bytes, the manifest says {size}; the file is damaged: copy it again")
        if verify == "checksum":
            got = file_sha256(p, f)
            if got != sha:
                raise ShardError(f"{p}: checksum mismatch (sha256 {got[:12]}.., manifest "
                                 f"{sha[:12]}..): the file is corrupt; copy it again")
        n += 1
        total += size
    return n, total


def check_footer(pf, manifest: dict, path: str, rows: int | None = None) -> None:
    """A Parquet shard's footer (a ``pq.ParquetFile``) agrees with the manifest: the schema
    fingerprint, the format version and (given ``rows``) the row count."""
    sch = pf.schema_arrow
    fp = schema_fingerprint(sch)
    if fp != manifest["schema_fingerprint"]:
        have = {x.name: str(x.type) for x in sch}
        want = {n: t for n, t, _ in manifest.get("schema", [])}
        diff = sorted(set(have.items()) ^ set(want.items()))[:4]
        raise ShardError(f"{path}: schema differs from the manifest (schema fingerprint {fp}, the manifest's "
                         f"{manifest['schema_fingerprint']}; e.g. {diff}): the file is from another shard set; "
                         "copy the set again or rerun preshard with this schema")
    v = (sch.metadata or {}).get(b"userwise.format_version")
    try:
        same = v is not None and int(v) == int(manifest["format_version"])
    except ValueError:  # a damaged footer
        same = False
    if not same:
        raise ShardError(f"{path}: format version {v.decode(errors='replace') if v is not None else None!r} differs from the manifest's "
                         f"{manifest['format_version']}")
    if rows is not None and pf.metadata.num_rows != int(rows):
        raise ShardError(f"{path}: {pf.metadata.num_rows} rows, the manifest says {rows}; the file is from "
                         "another shard set: copy it again")


def check_parquet(path: str, manifest: dict, fs=None, rows: int | None = None) -> None:
    """Open a Parquet shard and check its footer against the manifest (:func:`check_footer`)."""
    import pyarrow.parquet as pq

    f, p = resolve(path, fs)
    try:
        with f.open_input_file(p) as src:
            check_footer(pq.ParquetFile(src), manifest, path, rows)
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged footer
        raise ShardError(f"{path}: not a readable Parquet file ({e})") from None


def verify(root: str, node: int | None = None, checksums: bool = True, fs=None) -> dict:
    """Every listed shard (of ``node``, or all) exists with its size, checksum, schema and rows.

    Returns ``{"files": n, "bytes": b}``; raises ShardError naming the first bad file.
    """
    m = load(root, fs)
    f, base = resolve(root, fs)
    shards = m["shards"] if node is None else node_shards(m, node)
    n = total = 0
    for s in shards:
        k, b = check_files(base, s, verify="checksum" if checksums else "size", fs=f)
        n, total = n + k, total + b
        check_parquet(join(base, s["path"]), m, f, rows=s["rows"])
    return {"files": n, "bytes": total}
