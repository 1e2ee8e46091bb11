import json

import pyarrow as pa
import pytest

from tests.support.common import LEAN_CFG, fat_cfg
from userwise import schemas as S
from userwise.pipelines import config as C
from userwise.pipelines.errors import InputError


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
    assert "imp__click" in sch.names and "req__device" in sch.names and "req__country" in sch.names
    assert "seq_category" in sch.names and "seq_action" in sch.names
    assert "imp__user_id" not in sch.names
    # the request key and the int64 request time are req_id / req_time, not stored a second time
    assert "req__request_id" not in sch.names and "req__request_ts" not in sch.names
    assert roles["request_derived"] == {"request_id": "req_id", "request_ts": "req_time"}


@pytest.mark.parametrize("time_type, stored", [(pa.int64(), False), (pa.timestamp("ms", tz="UTC"), True),
                                               (pa.int32(), True)])
def test_only_an_int64_request_time_is_derived(time_type, stored):
    """req_time is the request time converted to time units (a long): it equals the input's
    value only for an int64 column, so any other type keeps its own req__ copy (the round
    trip returns it exactly). The request key is always req_id (its own type and values).
    Every request-level column is still checked across a request's rows."""
    base = S.SYNTH_IMPRESSIONS.to_arrow()
    arrow = base.set(base.get_field_index("request_ts"), pa.field("request_ts", time_type, False))
    lay = C.parse(LEAN_CFG).layout(arrow)
    names = S.samples_schema(lay).to_arrow().names
    assert ("req__request_ts" in names) == stored
    assert "req__request_id" not in names and "req_id" in names
    assert ("request_ts" in lay.derived_request_columns) == (not stored)
    assert {"request_id", "request_ts"} <= {f.name for f in lay.request_columns}
    assert S.requests_schema(lay).to_arrow().names.count("req__request_ts") == int(stored)


def test_without_a_request_column_the_time_is_the_key():
    cfg = json.loads(json.dumps(LEAN_CFG))
    del cfg["columns"]["request"]
    lay = C.parse(cfg).layout(S.SYNTH_IMPRESSIONS.to_arrow())
    assert lay.derived_request_columns == {"request_ts": "req_time"}
    assert "req__request_ts" not in S.samples_schema(lay).to_arrow().names


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


def test_a_build_folder_of_an_older_format_is_refused_with_a_way_out(tmp_path):
    """Format 1 stored the request key and time twice: its tables have columns this version
    no longer writes, so the jobs refuse such a folder by name instead of failing in a write."""
    import json as _json

    from userwise.pipelines.records import build_record

    lean, _ = layouts()
    build_record.save(str(tmp_path), C.parse(LEAN_CFG), lean)
    cfg, lay, meta = build_record.load(str(tmp_path))
    assert meta["format_version"] == S.FORMAT_VERSION and lay.derived_request_columns
    p = build_record.path(str(tmp_path))
    m = _json.load(open(p))
    m["format_version"] = 1
    _json.dump(m, open(p, "w"))
    with pytest.raises(InputError, match=r"format 1 .*rebuild the folder with `userwise build`"):
        build_record.load(str(tmp_path))


def test_build_record_is_read_in_one_place_with_errors_a_user_can_act_on(tmp_path):
    """``build_record.load`` is the one reader of build.json (daily, expand, preshard): every
    bad record is an InputError (one line on the CLI), never a traceback."""
    from userwise.pipelines.records import build_record

    with pytest.raises(InputError, match="not a userwise build folder"):
        build_record.load(str(tmp_path))
    lean, _ = layouts()
    build_record.save(str(tmp_path), C.parse(LEAN_CFG), lean)
    p = build_record.path(str(tmp_path))
    good = json.load(open(p))
    bad = [("{not json", "not valid JSON"),
           (json.dumps({**good, "format_version": S.FORMAT_VERSION + 1}), "newer"),
           (json.dumps({k: v for k, v in good.items() if k != "roles"}), r"lacks \['roles'\]"),
           (json.dumps({**good, "input_schema": "???"}), "not a serialized Arrow schema")]
    for text, match in bad:
        open(p, "w").write(text)
        with pytest.raises(InputError, match=match):
            build_record.load(str(tmp_path))


def test_duplicate_columns_rejected():
    with pytest.raises(S.SchemaError, match="duplicate"):
        S.TableSchema("t", (S.Field("x", pa.int64()), S.Field("x", pa.int64())))


def test_an_input_whose_schema_changed_since_the_build_is_refused(tmp_path):
    """A daily job whose input gained, lost or retyped a column since the folder was built is
    refused before it writes (one line naming the column), not failed in a Delta write."""
    import pyarrow as pa

    from userwise.pipelines.records import build_record

    cfg = C.parse(LEAN_CFG)
    base = S.SYNTH_IMPRESSIONS.to_arrow()
    build_record.save(str(tmp_path), cfg, cfg.layout(base))
    build_record.save(str(tmp_path), cfg, cfg.layout(base), as_of="2026-01-03")  # the same input: fine
    i = base.get_field_index("hour")
    retyped = base.set(i, pa.field("hour", pa.string()))
    with pytest.raises(InputError, match=r"column 'hour' was .* is now string.*new folder"):
        build_record.save(str(tmp_path), cfg, cfg.layout(retyped))
    with pytest.raises(InputError, match=r"column 'extra' is new"):
        build_record.save(str(tmp_path), cfg, cfg.layout(base.append(pa.field("extra", pa.int64()))))
    assert build_record.load(str(tmp_path))[1].input_schema.equals(cfg.layout(base).input_schema)


# ---------------------------------------------------------------------------
# Tables that explain themselves: column descriptions, action bits, docs/tables.md
# ---------------------------------------------------------------------------
def published_tables():
    """Every Delta table a build or a daily job writes, for the lean and the fat layout."""
    lean, fat = layouts()
    out = [S.QUARANTINE, S.HISTORY_LOG, S.ID_STATS]
    for lay in (lean, fat):
        out += [S.requests_schema(lay), S.events_schema(lay), S.history_schema(lay), S.samples_schema(lay)]
    return out


def test_every_column_of_the_published_tables_carries_its_description():
    """Each field's doc is its description in every form: the Arrow field metadata (what
    delta-rs writes as the Delta comment), the Spark StructField metadata (what Delta
    writes from Spark) and the Delta schema, under the key Spark and Delta use for comments."""
    from userwise.schemas.core import COMMENT

    tables = published_tables()
    assert {t.name for t in tables} == set(S.BUILD_TABLES)
    for t in tables:
        for f in t.fields:
            assert f.doc.strip(), (t.name, f.name)
        arrow = t.to_arrow()
        assert [af.metadata[COMMENT.encode()].decode() for af in arrow] == [f.doc for f in t.fields], t.name
        assert [d.metadata[COMMENT] for d in t.to_delta().fields] == [f.doc for f in t.fields], t.name
        assert S.schema_fingerprint(arrow) == S.schema_fingerprint(arrow.remove_metadata())


def test_descriptions_reach_spark(spark):
    from userwise.schemas.core import COMMENT

    for t in published_tables():
        assert [sf.metadata.get(COMMENT) for sf in t.to_spark().fields] == [f.doc for f in t.fields], t.name


def test_input_columns_are_described_by_their_own_name_and_type():
    schema = S.SYNTH_IMPRESSIONS.to_arrow()
    arrow = schema.set(schema.get_field_index("score"), pa.field("score", pa.timestamp("ms", tz="UTC")))
    arrow = arrow.set(arrow.get_field_index("device"), pa.field("the device", pa.string()))
    cfg = json.loads(json.dumps(LEAN_CFG))
    cfg["columns"]["context_features"] = ["the device" if c == "device" else c
                                          for c in cfg["columns"]["context_features"]]
    lay = C.parse(cfg).layout(arrow)
    docs = {f.name: f.doc for f in S.samples_schema(lay).fields}
    assert docs["imp__score"].endswith("input column `score` (timestamp[ms, tz=UTC])")
    assert docs["req__the%20device"] == "per request: input column `the device` (string)"
    assert {f.name: f.doc for f in S.requests_schema(lay).fields}["req__the%20device"] == \
        "input column `the device` (string), once per request"
    assert docs["seq_category"] == "per event, oldest first: item feature: input column `category` (int32)"


def test_seq_names_only_per_event_lists():
    """`seq_` starts only the names of per-event lists (one value per stored event); every
    count is a scalar with another name."""
    for t in published_tables():
        for f in t.fields:
            if f.name.startswith(S.SEQ):
                assert pa.types.is_list(f.type) and f.doc.startswith("per event"), (t.name, f.name)
    lean, fat = layouts()
    for lay in (lean, fat):
        names = S.samples_schema(lay).names
        assert "num_events" in names and "seq_len" not in names


def test_tables_with_an_action_mask_name_its_bits():
    lean, fat = layouts()
    key = S.ACTION_BITS
    assert lean.action_bits == ("click", "like")
    for lay in (lean, fat):
        for t in (S.requests_schema(lay), S.events_schema(lay), S.history_schema(lay), S.samples_schema(lay)):
            masks = {"imp_action", "ev_action", "seq_action"} & set(t.names)
            assert (key in t.properties) == bool(masks), (t.name, lay.fat)
            if masks:
                assert json.loads(t.properties[key]) == ["click", "like"]
    # fat samples hold no mask (their sequences are the snapshot's columns); their requests do
    assert key not in S.samples_schema(fat).properties and key in S.requests_schema(fat).properties
    # the order is the config's action_labels, by input name
    cfg = json.loads(json.dumps(LEAN_CFG))
    cfg["columns"]["action_labels"] = ["like", "click"]
    lay = C.parse(cfg).layout(S.SYNTH_IMPRESSIONS.to_arrow())
    assert json.loads(S.samples_schema(lay).properties[key]) == ["like", "click"] == list(lay.action_bits)


def test_decode_action():
    labels = ["click", "like", "share"]
    assert S.decode_action(0, labels) == []
    assert S.decode_action(1, labels) == ["click"]
    assert S.decode_action(6, labels) == ["like", "share"]
    assert S.decode_action(7, labels) == labels


def test_action_bits_are_read_without_spark(tmp_path):
    """``schemas.action_bits`` reads a table's property, or a build folder's samples' (else its
    requests'), with delta-rs; a path without them is refused in one line."""
    from deltalake import DeltaTable, write_deltalake

    def table(path, props):
        write_deltalake(str(path), pa.table({"a": [1]}))
        if props:
            DeltaTable(str(path)).alter.set_table_properties(props, raise_if_not_exists=False)

    table(tmp_path / "D" / "requests", {S.ACTION_BITS: json.dumps(["click", "like"])})
    table(tmp_path / "D" / "samples", {})  # fat samples: no mask
    assert S.action_bits(str(tmp_path / "D")) == ["click", "like"]
    assert S.action_bits(str(tmp_path / "D" / "requests") + "/") == ["click", "like"]
    with pytest.raises(S.SchemaError, match="no table property userwise.action_bits"):
        S.action_bits(str(tmp_path / "D" / "samples"))
    with pytest.raises(S.SchemaError, match="neither a Delta table nor a build folder"):
        S.action_bits(str(tmp_path))


# docs/tables.md's samples table (section "The samples table") lists every column of the lean and
# the fat samples: the columns named after the input's once, with placeholders.
README_BEGIN, README_END = "<!-- samples-columns -->", "<!-- /samples-columns -->"
PLACE = {"col": "<col>", "type": "its type"}


def _type_text(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return f"list<{_type_text(t.value_type)}>"
    return "date" if pa.types.is_date32(t) else str(t)


def samples_readme_rows() -> list[tuple[str, str, str]]:
    """(column, type, meaning) of every samples column, in schema order (fat-only ones last)."""
    from userwise.schemas import tables as T

    rows: dict[str, tuple[str, str, str]] = {}
    for lay in layouts():
        generic = {
            "user": ("user", "user type", None),
            "req_id": ("req_id", "list<request key type>", None),
            S.SEQ + "item": (S.SEQ + "item", "list<item type>", None),
        }
        for c in lay.stored_request_columns:
            generic[S.REQ + c.name] = (S.REQ + "<col>", "list<type>", T.SAMPLES_REQ_DOC.format(**PLACE))
        for c in lay.impression_columns:
            generic[S.IMP + c.name] = (S.IMP + "<col>", "list<type>", T.SAMPLES_IMP_DOC.format(**PLACE))
        for sf in lay.seq_fields:
            if lay.fat:
                generic[S.SEQ + sf.name] = (S.SEQ + "<role>", "list<element type>",
                                            T.EVENT_LIST + T.SNAPSHOT_FIELD_DOC.format(**PLACE))
                generic[S.OVR + sf.name] = (S.OVR + "<role>", "list<element type>",
                                            T.OVERRIDE_LIST + T.SNAPSHOT_FIELD_DOC.format(**PLACE))
            elif sf.source is not None:
                generic[S.SEQ + sf.name] = (S.SEQ + "<feature>", "list<type>",
                                            T.EVENT_LIST + T.FEATURE_DOC.format(**PLACE))
        for f in S.samples_schema(lay).fields:
            name, typ, doc = generic.get(f.name, (f.name, _type_text(f.type), None))
            row = (name, typ, doc or f.doc)
            assert rows.setdefault(name, row) == row, (name, rows[name], row)
    return list(rows.values())


def samples_readme_table() -> str:
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | `{t}` | {d} |" for n, t, d in samples_readme_rows()]
    return "\n".join(lines)


def test_the_docs_document_every_samples_column_as_the_schema_does():
    """docs/tables.md's samples table is the schema's docs: a column added, renamed or described
    differently in schemas/tables.py fails here until docs/tables.md says the same (the
    expected table is in the failure message)."""
    import pathlib

    text = (pathlib.Path(__file__).parents[2] / "docs" / "tables.md").read_text()
    assert README_BEGIN in text and README_END in text, "docs/tables.md lacks the samples table markers"
    got = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    want = samples_readme_table()
    assert got == want, "docs/tables.md's samples table differs from the schema; expected:\n" + want
