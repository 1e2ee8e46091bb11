import copy
import datetime as dt

import pytest
import yaml

from tests.support.common import LEAN_CFG, fat_cfg
from userwise import schemas as S
from userwise.pipelines import config as C


def cfg(**over):
    c = copy.deepcopy(LEAN_CFG)
    for k, v in over.items():
        if k.startswith("col_"):
            c["columns"][k[4:]] = v
        else:
            c[k] = v
    return c


def test_valid_lean_and_fat():
    lay = C.parse(LEAN_CFG).layout(S.SYNTH_IMPRESSIONS.to_arrow())
    assert not lay.fat and [f.name for f in lay.passthrough] == ["date", "score"]
    assert {f.name for f in lay.request_columns} == {"request_id", "request_ts", "device", "hour",
                                                   "age_bucket", "country"}
    fat = C.parse(fat_cfg()).layout(S.SYNTH_FAT_IMPRESSIONS.to_arrow())
    assert fat.fat and [s.name for s in fat.seq_fields] == ["item", "time", "category"]


@pytest.mark.parametrize("mutate,key,words", [
    (lambda c: c.update(foo=1), "foo", "unknown key"),
    (lambda c: c["columns"].update(itme="x"), "columns.itme", "did you mean 'item'"),
    (lambda c: c["columns"].pop("user"), "columns.user", "required role"),
    (lambda c: c["columns"].pop("labels"), "columns.labels", "required role"),
    (lambda c: c.update(time_unit="ns"), "time_unit", "not one of"),
    (lambda c: c.update(max_sample_cost=20), "max_sample_cost", "above max_seq_len"),
    (lambda c: c.update(history_length=5), "history_length", "at least L"),
    (lambda c: c.update(max_quarantine_share=2), "max_quarantine_share", "share"),
    (lambda c: c["columns"].update(labels="click"), "columns.labels", "list of column names"),
    (lambda c: c["columns"].update(action_labels=["dwell"]), "columns.action_labels", "not one of"),
    (lambda c: c.update(request_scope="session"), "request_scope", "not one of"),
    (lambda c: c.update(min_year=2000, max_year=1999), "max_year", "after min_year"),
    (lambda c: c.update(availability_lag=30), "availability_lag", "with its unit"),
    (lambda c: c.update(availability_lag="30 sec"), "availability_lag", "with its unit"),
    (lambda c: c.update(availability_lag="-5s"), "availability_lag", "with its unit"),
    (lambda c: c.update(availability_lag="1500us"), "availability_lag", "not a whole number of time_unit ms"),
    (lambda c: c.update(availability_lag="500ms", time_unit="s"), "availability_lag", "time_unit s"),
    (lambda c: c.update(chain_block=0), "chain_block", "at least 1"),
    (lambda c: c.update(chain_block="64"), "chain_block", "non-negative integer"),
    (lambda c: c["columns"].update(id_features=["score"]), "columns.id_features[0]", "not one of item_features"),
    (lambda c: c.update(hot_budget="3GB"), "hot_budget", "bytes with their unit"),
    (lambda c: c.update(warm_budget=-1), "warm_budget", "number of ids"),
    (lambda c: c.update(embedding_dim=0), "embedding_dim", "at least 1"),
])
def test_bad_config_names_the_key(mutate, key, words):
    c = copy.deepcopy(LEAN_CFG)
    mutate(c)
    with pytest.raises(C.ConfigError) as e:
        C.parse(c)
    assert e.value.key == key
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_availability_lag_and_chain_block():
    """The lag is a duration with its unit, read in the config's time unit (0 by default); a
    fat-row config refuses a non-zero one (its snapshots are what each request saw)."""
    assert C.parse(LEAN_CFG).lag_units == 0 and C.parse(LEAN_CFG).chain_block == 64
    for lag, unit, units in [("30s", "ms", 30_000), ("2h", "s", 7200), ("1d", "us", 86_400_000_000),
                             ("500ms", "ms", 500), (" 5m ", "ms", 300_000), (0, "s", 0), ("0s", "ms", 0)]:
        c = C.parse(cfg(availability_lag=lag, time_unit=unit, chain_block=8))
        assert (c.lag_units, c.chain_block) == (units, 8), lag
        assert C.parse(c.to_dict()) == c  # the build record keeps it as written
    with pytest.raises(C.ConfigError) as e:
        C.parse({**fat_cfg(), "availability_lag": "1s"})
    assert e.value.key == "availability_lag" and "fat rows" in str(e.value)
    assert C.parse({**fat_cfg(), "availability_lag": 0}).lag_units == 0


def test_id_columns_and_budgets():
    """The item is always an id column; a feature is one when columns.id_features lists it
    (by role, in the roles' order); a budget is ids, or bytes of rows of embedding_dim x
    embedding_bytes (the defaults: 256 MiB and 16 GiB of 128 float32s)."""
    c = C.parse(cfg(col_id_features=["country", "category", "device"]))
    assert c.id_columns == (("item", "item_id"), ("item_feature", "category"), ("context_feature", "device"),
                            ("user_feature", "country"))
    assert C.parse(LEAN_CFG).id_columns == (("item", "item_id"),)
    assert C.parse(LEAN_CFG).budget_ids == (256 * 2**20 // 512, 16 * 2**30 // 512)
    c = C.parse(cfg(hot_budget=10, warm_budget="1KiB", embedding_dim=16, embedding_bytes=2))
    assert c.budget_ids == (10, 32)
    assert C.parse(c.to_dict()) == c


@pytest.mark.parametrize("mutate,key,words", [
    (lambda c: c["columns"].update(item="itm_id"), "columns.item", "not in the input"),
    (lambda c: c["columns"].update(labels=["click", "device"]), "columns.labels[1]", "not numeric"),
    (lambda c: c["columns"].update(request_time="device"), "columns.request_time", "expected integer epoch"),
    (lambda c: c["columns"].update(sequence={"item": "item_id", "time": "request_ts"}),
     "columns.sequence.item", "not a list column"),
    (lambda c: c["columns"].update(user="score"), "columns.user", "an id must be an integer or a string"),
    (lambda c: c["columns"].update(item_features=["category", "score"], id_features=["score"]),
     "columns.id_features[0]", "an id feature must be an integer or string"),
])
def test_config_against_input(mutate, key, words):
    c = copy.deepcopy(LEAN_CFG)
    mutate(c)
    with pytest.raises(C.ConfigError) as e:
        C.parse(c).layout(S.SYNTH_IMPRESSIONS.to_arrow())
    assert e.value.key == key and words in str(e.value)


def test_load_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(LEAN_CFG))
    assert C.load(p).max_seq_len == 20
    p.write_text("columns: [unclosed")
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load(p)
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load(tmp_path / "nope.yaml")


def test_actions_section():
    c = copy.deepcopy(LEAN_CFG)
    c["columns"]["actions"] = {"user": "uid", "item": "iid", "time": "ts", "labels": "bits",
                               "item_features": ["cat", "auth"]}
    cf = C.parse(c)
    assert cf.actions.labels == "bits"
    C.check_actions_columns(cf, S.SYNTH_ACTIONS.to_arrow())
    c["columns"]["actions"]["item_features"] = ["cat"]
    with pytest.raises(C.ConfigError, match="one action-log column per impression item feature"):
        C.parse(c)


def test_defaults_take_any_real_log():
    c = C.parse({k: v for k, v in LEAN_CFG.items() if k not in ("min_year", "max_year")})
    assert (c.min_year, c.max_year, c.request_scope) == (1970, None, "global")
    assert C.parse(dict(c.to_dict(), max_year=None)).max_year is None


def test_a_type_the_build_cannot_carry_is_refused_by_name():
    import pyarrow as pa

    sch = S.SYNTH_IMPRESSIONS.to_arrow().append(pa.field("half", pa.float16()))
    with pytest.raises(C.ConfigError, match="column 'half' is halffloat, which the build cannot carry"):
        C.parse(LEAN_CFG).layout(sch)


def test_odd_names_and_our_names_never_collide():
    """Input columns get storage names (percent-encoded where Spark or Delta would refuse
    them, and where they start with our working prefix `_`); user-named sequence fields
    equal to ours get a leading `_`. The source schema keeps the input's own names and types."""
    import pyarrow as pa

    from userwise.schemas.layout import input_name, storage_name

    for n in ("user.id", "item price", "_user", "a,b;c{d}(e)=f\tg\nh`i", "50%", "plain", "ünï"):
        assert input_name(storage_name(n)) == n
        assert not storage_name(n).startswith("_") and not set(storage_name(n)) & set(" .,;{}()=`\t\n")
    sch = pa.schema([("user.id", pa.uint32()), ("t", pa.timestamp("ns", tz="Asia/Tokyo")), ("item", pa.string()),
                     ("click", pa.int8()), ("len", pa.int32()), ("action", pa.int8()), ("ts", pa.int64()),
                     ("item price", pa.float64())])
    cfg = C.parse({"columns": {"user": "user.id", "request_time": "t", "item": "item", "labels": ["click"],
                               "item_features": ["len", "action", "ts", "item price"]}})
    lay = cfg.layout(sch)
    assert lay.input_schema.names == ["user%2Eid", "t", "item", "click", "len", "action", "ts", "item%20price"]
    assert lay.input_schema.field("t").type == pa.int64() and lay.input_schema.field("user%2Eid").type == pa.int64()
    assert lay.source_schema == sch
    assert [s.name for s in lay.seq_fields] == ["ts", "item", "_len", "_action", "_ts", "item%20price", "action"]
    assert "t" not in lay.derived_request_columns  # a ns timestamp is not the int64 time itself
    for t in (S.samples_schema(lay), S.events_schema(lay), S.requests_schema(lay), S.history_schema(lay)):
        assert len(t.names) == len(set(t.names)), t.names
    assert cfg.layout(lay.input_schema) == lay  # a build record's storage schema resolves to the same layout


def test_time_range_without_max_year_ends_a_day_ahead_of_the_clock():
    c = C.parse({k: v for k, v in LEAN_CFG.items() if k not in ("min_year", "max_year")})
    today = dt.date(2026, 3, 10)
    lo, hi, what = C.time_range(c, today)
    ups = c.units_per_second
    assert lo == 0  # 1970-01-01
    assert hi == C.day_start(dt.date(2026, 3, 12), ups)  # the end of the day after today
    assert "2026-03-11" in what and "min_year 1970" in what
    lo, hi, what = C.time_range(C.parse(dict(c.to_dict(), min_year=2000, max_year=2030)), today)
    assert (lo, hi) == (C.day_start(dt.date(2000, 1, 1), ups), C.day_start(dt.date(2030, 1, 1), ups))
    assert "max_year 2030" in what
