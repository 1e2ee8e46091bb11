"""The report's bytes_in: the input's data bytes for every form --input takes (no Spark)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from userwise.pipelines.builder.build import input_bytes
from userwise.pipelines.runtime import delta_io, storage


def _log(root):
    """A hive folder of two days, with what Spark and Delta leave beside data."""
    sizes = {}
    for day, n in (("2026-01-01", 50), ("2026-01-02", 80)):
        d = root / "log" / f"date={day}"
        d.mkdir(parents=True)
        p = d / "part-0.parquet"
        pq.write_table(pa.table({"user_id": list(range(n)), "item_id": list(range(n))}), p)
        sizes[day] = os.path.getsize(p)
        (d / ".part-0.parquet.crc").write_bytes(b"x" * 100)
    (root / "log" / "_SUCCESS").write_bytes(b"y" * 100)
    (root / "log" / "_tmp").mkdir()
    (root / "log" / "_tmp" / "part-9.parquet").write_bytes(b"z" * 1000)
    return root / "log", sizes


def test_bytes_of_a_folder_a_file_a_glob_and_a_list(tmp_path):
    log, sizes = _log(tmp_path)
    total = sum(sizes.values())
    one = str(log / "date=2026-01-01" / "part-0.parquet")
    assert storage.du(str(log)) == total  # hidden files and folders are not data
    assert input_bytes(str(log)) == total
    assert input_bytes("file://" + str(log)) == total
    assert input_bytes(one) == sizes["2026-01-01"]
    assert input_bytes(str(log / "date=*")) == total
    assert input_bytes(str(log / "date=*" / "*.parquet")) == total
    assert input_bytes(f"{log / 'date=2026-01-01'},{log / 'date=2026-01-02'}") == total
    assert input_bytes(f"{one}, {log / 'date=2026-01-02'}") == total
    assert input_bytes(str(tmp_path / "nothing")) == 0


def test_bytes_of_a_delta_input_are_its_version_s_files(tmp_path):
    from deltalake import write_deltalake

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"user_id": list(range(100))}))
    write_deltalake(path, pa.table({"user_id": list(range(300))}), mode="overwrite")
    v0, v1 = delta_io.table_bytes(path, 0), delta_io.table_bytes(path)
    assert 0 < v0 < v1
    assert input_bytes(path) == v1  # the current version, not every file left on disk
    assert input_bytes(f"{path}@v0") == v0
    assert input_bytes(f"{path}@v0,{path}") == v0 + v1
