"""Tiny hand-written configs shared by tests."""

import json

LEAN_CFG = {
    "columns": {
        "user": "user_id", "request": "request_id", "request_time": "request_ts",
        "action_time": "action_ts", "item": "item_id", "position": "position",
        "labels": ["click", "like"], "item_features": ["category", "author"],
        "context_features": ["device", "hour"], "user_features": ["age_bucket", "country"],
    },
    "time_unit": "ms", "max_seq_len": 20, "history_length": 40, "max_sample_cost": 200,
}


def fat_cfg():
    c = json.loads(json.dumps(LEAN_CFG))
    c["columns"]["sequence"] = {"item": "hist_item_id", "time": "hist_ts", "category": "hist_category"}
    return c


