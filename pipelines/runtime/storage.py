"""Where the product's files live: a local path or a cluster store's URL, as one pyarrow filesystem.

Every path the product handles outside Spark (build records, completion records, locks,
Delta logs read for versions and sizes, shard sets, manifests) goes through
:func:`filesystem`, so that a build folder or a shard set on ``hdfs://``, ``s3://`` or
``gs://`` works as a local folder does. Spark reads and writes the same URLs with its own
Hadoop client (``--conf`` passes its settings).

- a path or ``file://`` URL: pyarrow's local filesystem;
- ``hdfs://nn:port/p``: pyarrow's native HDFS client where libhdfs is installed (a Hadoop
  distribution on the machine, ``ARROW_LIBHDFS_DIR`` / ``HADOOP_HOME``), else WebHDFS
  through fsspec at ``$USERWISE_WEBHDFS`` (``host:port`` of the name node's HTTP server;
  default: the name node's host, port 9870);
- ``webhdfs://host:port/p``: WebHDFS at that address;
- any other URL: pyarrow's own filesystem for it (``s3://`` and Hadoop's ``s3a://``,
  ``gs://``, with the standard credentials of each: ``AWS_*`` variables and
  ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``), else fsspec's.

Example::

    fs, p = storage.filesystem("hdfs://nn:8020/warehouse/D")
    storage.write_bytes("hdfs://nn:8020/warehouse/D/_userwise/x.json", b"{}")
"""

from __future__ import annotations

import functools
import os
import posixpath
import shutil
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from userwise.pipelines.errors import StorageError

WEBHDFS_ENV = "USERWISE_WEBHDFS"


def settings() -> dict[str, str]:
    """This process's store settings, to ship to Spark's executors with a job's config
    (an executor's Python worker need not share the driver's environment)."""
    return {k: os.environ[k] for k in (WEBHDFS_ENV, "HADOOP_USER_NAME") if os.environ.get(k)}


def apply(shipped: dict[str, str] | None) -> None:
    """Take the driver's :func:`settings` where this process has none of its own."""
    for k, v in (shipped or {}).items():
        if not os.environ.get(k):
            os.environ[k] = v


def is_local(path: str) -> bool:
    return "://" not in str(path) or str(path).startswith("file:")


def local_path(path: str) -> str:
    """The absolute local path of a path or ``file:`` URL."""
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif path.startswith("file:"):
        path = path[len("file:"):]
    return os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (never ``os.path`` on a URL)."""
    if is_local(base) and not str(base).startswith("file:"):
        return os.path.join(base, *parts)
    return posixpath.join(str(base).rstrip("/"), *parts)


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is (without a trailing slash)."""
    return os.path.abspath(path) if "://" not in str(path) else str(path).rstrip("/")


@functools.lru_cache(maxsize=None)
def _native_hdfs(host: str, port: int):
    try:
        return pafs.HadoopFileSystem(host, port)
    except (OSError, ImportError, RuntimeError):  # no libhdfs / JVM here: WebHDFS instead
        return None


@functools.lru_cache(maxsize=None)
def _webhdfs(host: str, port: int, user: str | None):
    import fsspec

    fs = fsspec.filesystem("webhdfs", host=host, port=port, user=user, skip_instance_cache=True)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _webhdfs_address(default_host: str) -> tuple[str, int]:
    addr = os.environ.get(WEBHDFS_ENV, "").strip()
    if addr.startswith(("http://", "https://", "webhdfs://")):
        addr = addr.split("://", 1)[1]
    addr = addr.rstrip("/")
    if not addr:
        return default_host or "localhost", 9870
    host, _, port = addr.rpartition(":")
    if not host:
        return addr, 9870
    return host, int(port)


def filesystem(url: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or any URL (module docstring).

    Raises :class:`StorageError` (one line) when nothing here opens it."""
    url = str(url)
    if is_local(url):
        return pafs.LocalFileSystem(), local_path(url)
    u = urlsplit(url)
    path = u.path.rstrip("/") or "/"
    if u.scheme == "hdfs":
        if not os.environ.get(WEBHDFS_ENV):
            native = _native_hdfs(u.hostname or "default", u.port or 8020)
            if native is not None:
                return native, path
        host, port = _webhdfs_address(u.hostname or "localhost")
        return _webhdfs(host, port, u.username or os.environ.get("HADOOP_USER_NAME") or _user()), path
    if u.scheme in ("webhdfs", "swebhdfs"):
        return _webhdfs(u.hostname or "localhost", u.port or 9870,
                        u.username or os.environ.get("HADOOP_USER_NAME") or _user()), path
    if u.scheme in ("s3a", "s3n"):  # Hadoop's names for S3: pyarrow's S3 (AWS_* variables, AWS_ENDPOINT_URL)
        url = "s3" + url[len(u.scheme):]
    try:
        f, p = pafs.FileSystem.from_uri(url)
        return f, p.rstrip("/") or "/"
    except Exception:  # noqa: BLE001 - not a pyarrow scheme: try fsspec
        try:
            import fsspec

            f, p = fsspec.core.url_to_fs(url)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"{url}: cannot open this location ({e}); use a local path or a URL of "
                               "hdfs://, s3://, gs:// or another fsspec filesystem") from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(f)), p.rstrip("/") or "/"


def _user() -> str | None:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def glob(pattern: str) -> list[str]:
    """The URLs matching a glob of a URL (``hdfs://nn:8020/logs/date=2026-01-*``), sorted."""
    u = urlsplit(pattern)
    fs, p = filesystem(pattern)
    raw = getattr(getattr(fs, "handler", None), "fs", None)
    if raw is None:
        import fsspec

        raw, p = fsspec.core.url_to_fs(pattern)
    if u.scheme in ("hdfs", "webhdfs", "swebhdfs"):
        base = f"{u.scheme}://{u.netloc}"
        return sorted(base + "/" + h.lstrip("/") for h in raw.glob(p))
    return sorted(f"{u.scheme}://{h.lstrip('/')}" for h in raw.glob(p))


def info(url: str) -> pafs.FileInfo:
    fs, p = filesystem(url)
    return fs.get_file_info(p)


def exists(url: str) -> bool:
    return info(url).type != pafs.FileType.NotFound


def is_dir(url: str) -> bool:
    return info(url).type == pafs.FileType.Directory


def du(url: str) -> int:
    """Bytes of the data files at ``url``: a file's size, or the files under a folder whose
    names (and folders' names below it) do not start with ``_`` or ``.`` (Spark's convention
    for what is not data: ``_delta_log``, ``_SUCCESS``, ``.crc``); 0 when nothing is there."""
    fs, root = filesystem(url)
    top = fs.get_file_info(root)
    if top.type == pafs.FileType.File:
        return int(top.size or 0)
    if top.type != pafs.FileType.Directory:
        return 0
    base = root.rstrip("/") + "/"
    total = 0
    for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        rel = i.path[len(base):] if i.path.startswith(base) else i.base_name
        if i.type == pafs.FileType.File and not any(p.startswith(("_", ".")) for p in rel.split("/")):
            total += int(i.size or 0)
    return total


def listdir(url: str) -> list[str]:
    """Base names in a folder ([] when it does not exist)."""
    fs, p = filesystem(url)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    return [posixpath.basename(i.path.rstrip("/")) for i in fs.get_file_info(pafs.FileSelector(p))]


def walk(url: str):
    """``os.walk`` for a local path or a URL: (folder, sub-folder names, file names) top-down,
    each folder as :func:`join` of ``url`` and its names; removing names from the yielded
    sub-folder list prunes them. Nothing when ``url`` is not a folder."""
    if is_local(url):
        yield from os.walk(local_path(url))
        return
    fs, top = filesystem(url)
    if fs.get_file_info(top).type != pafs.FileType.Directory:
        return
    stack = [(str(url).rstrip("/"), top)]
    while stack:
        d, p = stack.pop()
        infos = fs.get_file_info(pafs.FileSelector(p))
        subs = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
        files = sorted(i.base_name for i in infos if i.type == pafs.FileType.File)
        yield d, subs, files
        stack += [(join(d, s), posixpath.join(p, s)) for s in reversed(subs)]


def rmtree(url: str) -> None:
    """Delete a folder and everything below it (nothing when it is not there)."""
    if is_local(url):
        shutil.rmtree(local_path(url), ignore_errors=True)
        return
    fs, p = filesystem(url)
    _unless_missing(fs, p, fs.delete_dir)


def _unless_missing(fs: pafs.FileSystem, p: str, op) -> None:
    """``op(p)``, where a path that is not there is not an error."""
    try:
        op(p)
    except FileNotFoundError:
        pass
    except OSError:
        if fs.get_file_info(p).type != pafs.FileType.NotFound:
            raise


def copy_file(src: str, dst: str) -> None:
    """Copy one file: on one object store a server-side copy (S3's CopyObject: no byte passes
    through this process), else a stream through this process."""
    fs, p = filesystem(src)
    fd, q = filesystem(dst)
    fd.create_dir(posixpath.dirname(q), recursive=True)
    if not renames_folders(src) and urlsplit(str(src)).netloc == urlsplit(str(dst)).netloc and type(fs) is type(fd):
        fs.copy_file(p, q)
        return
    with fs.open_input_stream(p) as i, fd.open_output_stream(q) as o:
        while b := i.read(8 << 20):
            o.write(b)


def read_bytes(url: str) -> bytes | None:
    """The file's bytes; None when it does not exist."""
    fs, p = filesystem(url)
    try:
        with fs.open_input_stream(p) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError:
        if fs.get_file_info(p).type == pafs.FileType.NotFound:
            return None
        raise


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` so that readers see the old file or the whole new one: a temporary
    file next to it, then one rename (local: after fsync); on an object store one PUT, which
    readers see whole or not at all."""
    if is_local(url):
        p = local_path(url)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        return
    fs, p = filesystem(url)
    fs.create_dir(posixpath.dirname(p), recursive=True)
    if not renames_folders(url):
        with fs.open_output_stream(p) as fh:
            fh.write(data)
        return
    tmp = f"{posixpath.dirname(p)}/.{posixpath.basename(p)}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as fh:
        fh.write(data)
    replace(fs, tmp, p)


def remove(url: str) -> None:
    fs, p = filesystem(url)
    _unless_missing(fs, p, fs.delete_file)


def create_exclusive(url: str, data: bytes) -> bool:
    """Create ``url`` holding ``data`` unless it exists; False when it does.

    Atomic on a local filesystem, on HDFS (its name node creates a file once: WebHDFS
    ``CREATE`` with ``overwrite=false``) and on S3 (``s3://``, ``s3a://``) where boto3 is
    installed: one ``PutObject`` with ``If-None-Match: *``, which S3 applies only when no
    object has the key (412 otherwise), with the ``AWS_*`` variables' credentials and
    ``AWS_ENDPOINT_URL``. Without boto3, and on other object stores, it checks then writes:
    two writers that both check before either writes both get True."""
    if is_local(url):
        p = local_path(url)
        try:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    if is_s3(url):
        created = _s3_create_once(str(url), data)
        if created is not None:
            return created
    fs, p = filesystem(url)
    web = _raw_webhdfs(fs)
    if web is not None:
        return _webhdfs_create(web, p, data)
    if fs.get_file_info(p).type != pafs.FileType.NotFound:
        return False
    with fs.open_output_stream(p) as fh:  # object stores: no exclusive create; check, then write
        fh.write(data)
    return True


_S3_SCHEMES = ("s3", "s3a", "s3n")


def is_s3(url) -> bool:
    """Whether ``url`` names S3 (``s3://``, and Hadoop's ``s3a://`` and ``s3n://``)."""
    return urlsplit(str(url or "")).scheme in _S3_SCHEMES


@functools.lru_cache(maxsize=8)
def _s3_client(endpoint: str | None, region: str | None, key: str | None):
    """A boto3 S3 client for these settings (boto3 reads the credentials from the same
    ``AWS_*`` variables); None without boto3. Keyed by the settings, so a changed
    environment gets a new client."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region or None,
                        config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _s3_create_once(url: str, data: bytes) -> bool | None:
    """``PutObject`` with ``If-None-Match: *``: True when this call created the object, False
    when one was there; None when this process cannot make the request (no boto3), or the
    store does not implement conditional writes (501), for the caller's check-then-write."""
    client = _s3_client(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
                        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                        os.environ.get("AWS_ACCESS_KEY_ID"))
    if client is None:
        return None
    from botocore.exceptions import BotoCoreError, ClientError

    u = urlsplit(url)
    bucket, key = u.netloc, u.path.lstrip("/")
    attempt = 0
    while True:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            err = e.response.get("Error", {})
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412 or err.get("Code") == "PreconditionFailed":
                return False
            if status == 501 or err.get("Code") == "NotImplemented":
                return None
            attempt += 1
            if status == 409 and attempt < 5:  # ConditionalRequestConflict: a racing write of the key; again
                import time

                time.sleep(0.05 * attempt)
                continue
            raise OSError(f"{url}: cannot create it on S3 ({err.get('Code')}: {err.get('Message')})") from None
        except BotoCoreError as e:
            raise OSError(f"{url}: cannot reach S3 ({e})") from None


def _raw_webhdfs(fs):
    """The fsspec WebHDFS client behind a pyarrow filesystem, or None."""
    raw = getattr(getattr(fs, "handler", None), "fs", None)
    try:
        from fsspec.implementations.webhdfs import WebHDFS
    except ImportError:
        return None
    return raw if isinstance(raw, WebHDFS) else None


def _webhdfs_create(fs, path: str, data: bytes) -> bool:
    """WebHDFS CREATE with overwrite=false: the name node creates a file once."""
    try:
        r = fs._call("CREATE", method="put", path=path, redirect=False, overwrite="false")
    except RuntimeError as e:
        if "exist" in str(e).lower():
            return False
        raise OSError(f"{path}: {e}") from None
    r2 = fs.session.put(fs._apply_proxy(r.headers["Location"]), data=data,
                        headers={"content-type": "application/octet-stream"})
    if r2.status_code >= 400:
        if "FileAlreadyExists" in r2.text or "already exists" in r2.text:
            return False
        raise OSError(f"{path}: WebHDFS CREATE failed ({r2.status_code}: {r2.text[:200]})")
    return True


def mtime(url: str) -> float | None:
    fs, p = filesystem(url)
    web = _raw_webhdfs(fs)
    if web is not None:  # pyarrow's wrapper does not carry WebHDFS' modificationTime
        try:
            return web.info(p)["modificationTime"] / 1000.0
        except FileNotFoundError:
            return None
    i = fs.get_file_info(p)
    if i.type == pafs.FileType.NotFound:
        return None
    return i.mtime.timestamp() if i.mtime is not None else None


def touch(url: str) -> None:
    """Renew the file's modification time (local: utime; HDFS: SETTIMES)."""
    if is_local(url):
        os.utime(local_path(url))
        return
    fs, p = filesystem(url)
    web = _raw_webhdfs(fs)
    if web is not None:
        import time

        web._call("SETTIMES", method="put", path=p, modificationtime=str(int(time.time() * 1000)))
        return
    data = read_bytes(url)  # object stores: rewrite the object
    if data is not None:
        with fs.open_output_stream(p) as fh:
            fh.write(data)


_RENAMING = ("hdfs", "webhdfs", "swebhdfs", "viewfs")


def renames_folders(url: str) -> bool:
    """Whether the store renames a folder in one operation: a local or POSIX shared filesystem,
    HDFS. Object stores (S3, GCS, ...) have no folder rename (a "move" copies every object)."""
    return is_local(url) or urlsplit(str(url)).scheme in _RENAMING


def swap_in(src: str, dst: str, old: str, last: tuple[str, ...] = ()) -> None:
    """Put the folder ``src`` in the place of ``dst`` (which may not exist), and remove ``src``.

    Where folders rename (:func:`renames_folders`): ``dst`` is renamed to ``old``, ``src`` to
    ``dst``, then ``old`` is removed: two renames, readers see the old folder or the new one.
    On an object store: the files ``last`` (names relative to the folder, e.g. the manifest and
    a publish marker) of ``dst`` are deleted first, so readers that key on them see no folder
    until it is whole; every other file of ``src`` is copied in (server-side), then ``last`` in
    their order; files of ``dst`` that ``src`` lacks are deleted and ``src`` is removed. A run
    killed half-way is completed by the same call (``src`` is removed last)."""
    if renames_folders(dst):
        if exists(dst):
            rename(dst, old)
        if not rename(src, dst):
            raise OSError(f"{src}: could not move it to {dst}")
        try:
            rmtree(old)
        except OSError:  # left for the caller's next run to remove
            pass
        return
    fs, s_root = filesystem(src)
    _, d_root = filesystem(dst)
    for name in last:
        _unless_missing(fs, f"{d_root}/{name}", fs.delete_file)
    files = [i.path[len(s_root) + 1:] for i in fs.get_file_info(pafs.FileSelector(s_root, recursive=True))
             if i.type == pafs.FileType.File]
    for rel in sorted(files, key=lambda r: (r in last, last.index(r) if r in last else 0, r)):
        copy_file(join(src, rel), join(dst, rel))
    keep = set(files)
    for i in fs.get_file_info(pafs.FileSelector(d_root, recursive=True, allow_not_found=True)):
        if i.type == pafs.FileType.File and i.path[len(d_root) + 1:] not in keep:
            fs.delete_file(i.path)
    rmtree(src)


def rename(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` (one rename; False when ``src`` is gone)."""
    if is_local(src):
        try:
            os.rename(local_path(src), local_path(dst))
            return True
        except FileNotFoundError:
            return False
    fs, p = filesystem(src)
    _, q = filesystem(dst)
    return _move(fs, p, q)


def replace(fs: pafs.FileSystem, tmp: str, path: str) -> None:
    """Move ``tmp`` onto ``path`` inside ``fs`` (one rename; on HDFS, whose rename never
    replaces a file, the old file is removed first: readers see no file for that moment)."""
    hdfs = _raw_webhdfs(fs) is not None or isinstance(fs, pafs.HadoopFileSystem)
    if hdfs and fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)
    if not _move(fs, tmp, path):
        raise OSError(f"{tmp}: gone before its rename to {path}")


def _move(fs: pafs.FileSystem, p: str, q: str) -> bool:
    web = _raw_webhdfs(fs)
    if web is not None:  # HDFS answers false (no error) when the source is gone or the target exists
        try:
            ok = web._call("RENAME", method="put", path=p, destination=q).json().get("boolean")
        except FileNotFoundError:
            return False
        if not ok and fs.get_file_info(p).type != pafs.FileType.NotFound:
            raise OSError(f"cannot rename {p} to {q} (the target exists or its folder is missing)")
        return bool(ok)
    try:
        fs.move(p, q)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        if fs.get_file_info(p).type == pafs.FileType.NotFound:
            return False
        raise
