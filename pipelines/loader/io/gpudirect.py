"""GPUDirect Storage: which data path a dataset reads by, and the reads of the GDS path.

:func:`choose_path` picks ``"gds"`` (the GDS side files read straight into device memory
by kvikio, when kvikio has its GDS driver, a GPU is the target and the shards have side
files), ``"gds-host"`` (the side files read on the host: a test path) or ``"parquet"``
(Parquet through host memory, pinned on CUDA hosts), and says once which and why.
:func:`read_side_files` reads row groups from the side files as flat columns
(:class:`~userwise.pipelines.loader.io.decode.Col`), on the device for ``"gds"``.

Example::

    path = choose_path(shards, "auto", torch.device("cuda"))   # "gds" or "parquet", said once
    cols = read_side_files(shards, [0, 1], columns, path, torch.device("cuda"))
"""

from __future__ import annotations

import numpy as np
import torch

from userwise.pipelines.errors import ArgumentError, ShardError
from userwise.pipelines.loader.io import decode
from userwise.pipelines.loader.logs import say_once
from userwise.pipelines.shards import gds as gdsmod

__all__ = ["kvikio_compat", "choose_path", "read_side_files"]


def kvikio_compat() -> bool:
    """True when kvikio would read without GPUDirect Storage (no cuFile driver: POSIX reads)."""
    import kvikio.defaults

    try:
        return bool(kvikio.defaults.is_compat_mode_preferred())
    except AttributeError:  # pragma: no cover (older kvikio)
        return bool(kvikio.defaults.compat_mode())


def choose_path(shards, gds, device: torch.device) -> str:
    """The data path for ``gds`` ("auto" | "device" | "host" | False, as
    :class:`~userwise.pipelines.loader.UserwiseDataset` takes it) and the target ``device``:
    "gds", "gds-host" or "parquet"; logged once per process with the reason."""
    gds = "auto" if gds is True else gds
    if gds not in ("auto", "device", "host", False, None):
        raise ArgumentError(f"gds must be 'auto', 'device', 'host' or False, got {gds!r}")
    have_side = all(s.get("gds_path") for s in shards.shards)
    if gds == "host":
        if not have_side:
            raise ShardError(f"{shards.root}: gds='host' but the shards have no GDS side files (preshard --layout gds)")
        path, why = "gds-host", "side files read on the host (test path)"
    elif gds == "device" and not (have_side and device.type == "cuda"):
        raise ShardError(f"{shards.root}: gds='device' needs GDS side files (preshard --layout gds) "
                         f"and a CUDA device (device={device})")
    elif gds in ("auto", "device") and have_side and device.type == "cuda":
        try:
            import kvikio  # noqa: F401
        except ImportError:
            if gds == "device":
                raise ShardError("gds='device' needs kvikio (pip install userwise[gds])") from None
            path, why = "parquet", "GDS fallback: kvikio is not importable"
        else:
            compat = kvikio_compat()
            if compat and gds == "auto":
                # kvikio without a GDS driver reads through POSIX and bounce buffers: several
                # times slower than Parquet + pinned memory (benchmarks/README.md, GPU)
                path, why = "parquet", ("GDS fallback: kvikio has no GDS driver here (compatibility mode); "
                                        "Parquet via pinned memory is faster. gds='device' forces kvikio")
            else:
                path = "gds"
                why = ("kvikio + GPU + side files: reading straight into device memory"
                       + (" (kvikio compatibility mode: POSIX reads, forced by gds='device')" if compat else ""))
    else:
        why = ("GDS not requested" if not gds else "no GDS side files" if not have_side else "no GPU")
        path = "parquet"
        why = f"Parquet via {'pinned memory' if device.type == 'cuda' else 'pageable memory (CPU only)'} ({why})"
    say_once(f"userwise loader: data path = {path}: {why}")
    return path


def read_side_files(shards, rgs, columns: list[str], data_path: str, device: torch.device) -> dict:
    """Row groups ``rgs`` of the GDS side files as flat columns: numeric columns straight into
    ``device`` memory for ``data_path="gds"`` (strings read on the host and copied there), all
    on the host for ``"gds-host"``."""
    parts, valid_parts, arrow = [], [], {}
    for g in rgs:
        path = shards.gds_path(int(shards.rg_shard[g]))
        idx = gdsmod.read_index(path)
        rg = idx["row_groups"][int(shards.rg_index[g])]
        arrow.update({n: rg["columns"][n]["arrow"] for n in columns})
        strings = [n for n in columns if "str_offsets" in rg["columns"][n]]
        numeric = [n for n in columns if n not in strings]
        host = gdsmod.read_host(path, int(shards.rg_index[g]), strings if data_path == "gds" else columns, index=idx)
        if data_path == "gds":
            dev = gdsmod.read_device(path, int(shards.rg_index[g]), numeric, device=device, index=idx)
            host = {k: tuple(None if a is None else torch.from_numpy(np.array(a)).to(device) for a in v)
                    for k, v in host.items()}
            host.update(dev)
        parts.append(host)
        vp = {}
        with open(path, "rb") as f:
            for n in columns:
                e = rg["columns"][n]
                if "validity" in e:
                    f.seek(e["validity"][0])
                    vp[n] = np.frombuffer(f.read(e["validity"][1]), np.uint8)
        valid_parts.append(vp)
    cols = decode.from_gds(parts, arrow)
    for n in cols:
        if any(n in vp for vp in valid_parts):
            vs = [vp[n] if n in vp else np.ones(len(p[n][2]) - 1 if len(p[n]) == 3 else len(p[n][0]), np.uint8)
                  for vp, p in zip(valid_parts, parts)]
            cols[n].validity = torch.from_numpy(np.concatenate(vs)).to(cols[n].values.device)
    return cols
