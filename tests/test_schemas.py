import json

import pyarrow as pa
import pytest

from userwise import schemas as S
from userwise.pipelines import config as C

from .common import LEAN_CFG, fat_cfg


def layouts():
    lean = C.parse(LEAN_CFG).layout(S.SYNTH_IMPRESSIONS.to_arrow())
    fat = C.parse(fat_cfg()).layout(S.SYNTH_FAT_IMPRESSIONS.to_arrow())
    return lean, fat


def all_tables():
    lean, fat = layouts()
    out = list(S.FIXED_TABLES)
    for lay in (lean, fat):
        out += [S.requests_schema(lay), S.events_schema(lay), S.history_schema(lay),
                S.samples_schema(lay), S.shard_schema(lay)]
    return out


@pytest.mark.parametrize("table", all_tables(), ids=lambda t: t.name)
def test_arrow_spark_delta_agree(table, spark):
    """The three forms derived from one definition agree, column by column."""
    arrow = table.to_arrow()
    sp = table.to_spark()
    assert [f.name for f in sp.fields] == arrow.names
    for af, sf in zip(arrow, sp.fields):
        assert S.arrow_to_spark(af.type) == sf.dataType
        assert af.nullable == sf.nullable
        # Spark's own Arrow conversion of our Spark type gives back the Arrow type
        assert S.spark_to_arrow(sf.dataType) == af.type or (
            pa.types.is_timestamp(af.type) and pa.types.is_timestamp(S.spark_to_arrow(sf.dataType))
        )
    delta = table.to_delta()
    assert [f.name for f in delta.fields] == arrow.names
    back = pa.schema(delta.to_arrow())
    for af, bf in zip(arrow, back):
        assert af.nullable == bf.nullable, af.name
        at, bt = af.type, bf.type
        if pa.types.is_timestamp(at):
            continue
        assert str(at).replace("large_", "").replace("string_view", "string") == \
            str(bt).replace("large_", "").replace("string_view", "string"), af.name
    # Spark writes an empty DataFrame with this schema and reads the same schema back.
    df = spark.createDataFrame([], sp)
    assert df.schema == sp


def test_struct_of_arrays_only():
    """Sequences and impressions are parallel lists of primitives, never lists of structs."""
    for t in all_tables():
        for f in t.to_arrow():
            if pa.types.is_list(f.type):
                assert not pa.types.is_nested(f.type.value_type), (t.name, f.name)


def test_samples_carry_roles_and_version():
    lean, _ = layouts()
    sch = S.samples_schema(lean).to_arrow()
    assert sch.metadata[b"userwise.format_version"] == str(S.FORMAT_VERSION).encode()
    roles = json.loads(sch.metadata[b"userwise.roles"])
    assert roles["labels"] == ["click", "like"]
    assert "imp__click" in sch.names and "req__request_ts" in sch.names
    assert "seq_category" in sch.names and "seq_action" in sch.names
    assert "imp__user_id" not in sch.names


def test_fingerprint_changes_with_types():
    a = S.TableSchema("t", (S.Field("x", pa.int64()),))
    b = S.TableSchema("t", (S.Field("x", pa.int32()),))
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == S.TableSchema("t", (S.Field("x", pa.int64(), doc="d"),)).fingerprint()


def test_version_check():
    S.check_version(S.FORMAT_VERSION, "x")
    with pytest.raises(S.SchemaError, match="newer"):
        S.check_version(S.FORMAT_VERSION + 1, "x")
    with pytest.raises(S.SchemaError, match="no userwise format version"):
        S.check_version(None, "x")


def test_duplicate_columns_rejected():
    with pytest.raises(S.SchemaError, match="duplicate"):
        S.TableSchema("t", (S.Field("x", pa.int64()), S.Field("x", pa.int64())))
