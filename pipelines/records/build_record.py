"""``D/_userwise/build.json``: what a build folder was made from.

It holds the config, the input's Arrow schema and the layout's roles, so
daily jobs, ``expand`` and ``preshard`` resolve the same layout without
re-reading the input. :func:`load` is its one reader.
"""

from __future__ import annotations

import base64
import json

import pyarrow as pa

from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.errors import InputError
from userwise.pipelines.records import folder
from userwise.pipelines.runtime import storage


def path(build_dir: str) -> str:
    return folder.build_json(build_dir)


def save(build_dir: str, cfg: C.Config, layout: S.Layout, **extra) -> None:
    p = path(build_dir)
    raw = storage.read_bytes(p)
    old = json.loads(raw) if raw is not None else {}
    if old.get("input_schema"):
        _same_input(build_dir, old["input_schema"], layout.input_schema)
    meta = {
        **old,
        "format_version": S.FORMAT_VERSION,
        "config": cfg.to_dict(),
        "roles": layout.roles(),
        "input_schema": base64.b64encode(layout.input_schema.serialize().to_pybytes()).decode(),
        **extra,
    }
    storage.write_bytes(p, json.dumps(meta, indent=1, sort_keys=True, default=str).encode())


def _same_input(build_dir: str, recorded: str, schema: pa.Schema) -> None:
    """Refuse an input whose columns differ from those the folder's tables were built from
    (a log whose schema changed between days): its rows would not fit the tables."""
    try:
        was = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(recorded)))
    except (ValueError, TypeError, pa.ArrowException):
        return  # a damaged record is load()'s to report
    was_t = {f.name: f.type for f in was}
    now_t = {f.name: f.type for f in schema}
    for name in sorted(set(was_t) | set(now_t)):
        if was_t.get(name) != now_t.get(name):
            what = ("is new" if name not in was_t else "is gone" if name not in now_t
                    else f"was {was_t[name]}, is now {now_t[name]}")
            raise InputError(f"the input's column {name!r} {what} since {build_dir} was built: its tables hold "
                             "the old columns; build the changed log into a new folder (or restore the "
                             "column in the input)")


def load(build_dir: str) -> tuple[C.Config, S.Layout, dict]:
    """(config, layout, the whole record) of the build folder ``build_dir``: the one reader of
    ``build.json`` (daily jobs, ``expand`` and ``preshard`` use it).

    Raises InputError (one line: what to do) when the folder is not a build folder, the
    record is damaged, or another format version wrote it."""
    p = path(build_dir)
    raw = storage.read_bytes(p)
    if raw is None:
        raise InputError(f"{build_dir} is not a userwise build folder (no {folder.META_DIR}/{folder.BUILD_JSON}); "
                         "run `userwise build` or `userwise requests` first")
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{p}: not valid JSON ({e}); rebuild the folder with `userwise build`") from None
    if not isinstance(meta, dict):
        raise InputError(f"{p}: not a build record (a JSON object); rebuild the folder with `userwise build`")
    try:
        S.check_version(meta.get("format_version"), p)
    except S.SchemaError as e:
        raise InputError(str(e)) from None
    if int(meta["format_version"]) < S.FORMAT_VERSION:  # its tables have other columns than this code writes
        raise InputError(f"{p}: written by userwise format {meta['format_version']} (its tables have "
                         f"other columns); this version writes format {S.FORMAT_VERSION}: rebuild the folder "
                         "with `userwise build`")
    missing = [k for k in ("config", "input_schema", "roles") if k not in meta]
    if missing:
        raise InputError(f"{p}: lacks {missing}; rebuild the folder with `userwise build`")
    cfg = C.parse(meta["config"], source=p)
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(meta["input_schema"])))
    except (ValueError, TypeError, pa.ArrowException) as e:
        raise InputError(f"{p}: input_schema is not a serialized Arrow schema ({e}); rebuild the folder "
                         "with `userwise build`") from None
    return cfg, cfg.layout(schema), meta
