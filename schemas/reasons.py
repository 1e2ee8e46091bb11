"""Why an input row is quarantined: the one vocabulary of the ``quarantine`` table's ``reason``.

Every reason the build writes is a constant here, with what it means. The build's
checks (``pipelines/builder/ingest.py``) mark rows with these constants, ``userwise
synth`` injects bad rows under these names, the tests' edge-case logs expect them and
docs/commands.md lists them; ``tests/schemas/test_reasons.py`` holds all of them to this table.

The per-row checks run first, then the checks across the rows of one request; a row
gets the first reason that applies.
"""

NULL_USER = "null_user"
NULL_REQUEST = "null_request"
NULL_TIME = "null_time"
BAD_TIME = "bad_time"
NULL_ITEM = "null_item"
NULL_POSITION = "null_position"
BAD_LABEL = "bad_label"
NULL_ACTION_TIME = "null_action_time"
ACTION_BEFORE_REQUEST = "action_before_request"
WRONG_PARTITION = "wrong_partition"
DUPLICATE_ROW = "duplicate_row"
REQUEST_USER_CONFLICT = "request_user_conflict"
REQUEST_INCONSISTENT = "request_inconsistent"
SNAPSHOT_MISMATCH = "snapshot_mismatch"
POSITION_CONFLICT = "position_conflict"
NULL_ARRIVAL_TIME = "null_arrival_time"
ARRIVAL_BEFORE_ACTION = "arrival_before_action"
ARRIVAL_BEFORE_REQUEST = "arrival_before_request"

REASONS: dict[str, str] = {
    NULL_USER: "the user key is null",
    NULL_REQUEST: "the request key is null",
    NULL_TIME: "the request time (an action log's action time) is null",
    BAD_TIME: "a request, action or arrival time outside min_year..max_year",
    NULL_ITEM: "the item is null",
    NULL_POSITION: "the position is null",
    BAD_LABEL: "a label is null, NaN or infinite",
    NULL_ACTION_TIME: "an action without an action time",
    ACTION_BEFORE_REQUEST: "the action is timed before its own request",
    WRONG_PARTITION: "the row is filed under another day than its request time's UTC day",
    DUPLICATE_ROW: "an exact copy of an earlier row (the first copy is kept)",
    REQUEST_USER_CONFLICT: "the request id is used by more than one user (the whole request)",
    REQUEST_INCONSISTENT: "request-level columns differ between the request's rows (the whole request)",
    SNAPSHOT_MISMATCH: "fat rows: impressions of one request carry different snapshots (the whole request)",
    POSITION_CONFLICT: "two different rows of one request at one position (both)",
    NULL_ARRIVAL_TIME: "an action without an arrival time, where the config's null_arrival is quarantine",
    ARRIVAL_BEFORE_ACTION: "the action arrived earlier than its action time less the config's arrival_skew",
    ARRIVAL_BEFORE_REQUEST: "an impression's action arrived before its own request (it would be visible to it)",
}
