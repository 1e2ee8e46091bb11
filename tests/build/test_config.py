import copy

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
])
def test_bad_config_names_the_key(mutate, key, words):
    c = copy.deepcopy(LEAN_CFG)
    mutate(c)
    with pytest.raises(C.ConfigError) as e:
        C.parse(c)
    assert e.value.key == key
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mutate,key,words", [
    (lambda c: c["columns"].update(item="itm_id"), "columns.item", "not in the input"),
    (lambda c: c["columns"].update(labels=["click", "device"]), "columns.labels[1]", "not numeric"),
    (lambda c: c["columns"].update(request_time="device"), "columns.request_time", "expected integer epoch"),
    (lambda c: c["columns"].update(sequence={"item": "item_id", "time": "request_ts"}),
     "columns.sequence.item", "not a list column"),
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
