"""Late events (issue 57, points 3 and 7). Held in arrival order, a user's events are one
stream that only grows: a late event (an action time older than events already held) is
appended to the held state, the whole state is reused and nothing is dropped; held by action
time, the same event lands mid-stream, the chain cuts the held state at the last verified
page before it and those events are encoded again. In both, the cached logits equal the full
recompute. The replay (``order="both"``) shows the difference on a ``synth --arrivals`` log
(a trace built without Spark, tests/support/late_trace.py): arrival order never invalidates;
action-time order invalidates exactly where an independent count over the raw events says a
late event landed before the held end, and encodes exactly the tokens it says; on a shard
set without late events the two orders cost the same."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from tests.support.late_trace import trace_of_log
from tests.support.shard_sets import one_node_set
from userwise.pipelines import cli
from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.serve import (
    Candidates,
    Events,
    KVStore,
    chain_of,
    extend,
    full_scores,
    longest_valid_prefix,
    prefill,
    read_trace,
    replay,
    score,
)
from userwise.pipelines.tools import synth
from userwise.pipelines.train import ReferenceRanker

P, L = 8, 12


def _model() -> ReferenceRanker:
    torch.manual_seed(0)
    return ReferenceRanker(dim=16, heads=2, layers=2, encoder="sample").double().eval()


def _events(n: int, times, seed: int = 0) -> Events:
    g = torch.Generator().manual_seed(seed)
    return Events(item=torch.randint(0, 1 << 20, (n,), generator=g), side=torch.randint(0, 1 << 20, (n, 2), generator=g),
                  action=torch.randint(1, 4, (n,), generator=g), time=torch.as_tensor(times))


CANDS = Candidates(item=torch.tensor([3, 77]), side=torch.tensor([[1, 2], [5, 6]]))


def _serve(store: KVStore, model, events: Events) -> int:
    """One request: look up by the chain of ``events``, extend by what the lease lacks, store,
    score; the cached logits equal the full recompute. Returns the events reused."""
    cur = chain_of(events, block=P, version="v")
    with store.acquire("u", cur) as lease:
        have = 0 if lease.state is None else lease.state.length
        st = prefill(model, events, max_seq_len=L, page_size=P) if lease.state is None else \
            extend(model, lease.state, events[have:])
        store.put("u", cur, st)
        got = score(model, st, CANDS)
    torch.testing.assert_close(got, full_scores(model, events, CANDS, L), rtol=0, atol=1e-9)
    return have


def test_a_late_event_appends_in_arrival_order_and_cuts_the_stream_in_action_time_order():
    model = _model()
    held = _events(21, np.arange(21) * 1000 + 10_000)
    late = _events(1, [12_500], seed=1)  # acted between held events 2 and 3, arrived after all of them
    # arrival order: appended; the whole held state (its unfinished last page too) is reused
    store = KVStore(page_size=P, device_bytes=1 << 20, device="cpu", max_seq_len=L)
    assert _serve(store, model, held) == 0
    arrived = held.cat(late)  # action times no longer monotone: extend and the chain do not read them
    assert longest_valid_prefix(chain_of(held, block=P, version="v").compact(),
                                chain_of(arrived, block=P, version="v")) == 21
    assert _serve(store, model, arrived) == 21
    s = store.stats()
    assert s["invalidated"] == 0 and s["reuse"] == {"full": 1, "partial": 0, "miss": 1}  # the first lookup: nothing held
    # action-time order: the same event lands at position 3, the held state is cut to page 0
    store = KVStore(page_size=P, device_bytes=1 << 20, device="cpu", max_seq_len=L)
    assert _serve(store, model, held) == 0
    k = int(np.searchsorted(held.time.numpy(), 12_500, side="right"))
    by_time = held[:k].cat(late).cat(held[k:])
    assert k == 3 and _serve(store, model, by_time) == 0  # 21 events encoded again
    s = store.stats()
    assert s["invalidated"] == 1 and s["reuse"]["miss"] == 2
    # a late event after the first page keeps that page only
    store = KVStore(page_size=P, device_bytes=1 << 20, device="cpu", max_seq_len=L)
    _serve(store, model, held)
    late2 = _events(1, [20_500], seed=2)
    k = int(np.searchsorted(held.time.numpy(), 20_500, side="right"))
    assert k == 11 and _serve(store, model, held[:k].cat(late2).cat(held[k:])) == 8
    assert store.stats()["reuse"]["partial"] == 1


# -- the replay on a synth log with late arrivals ------------------------------------------------


@pytest.fixture(scope="module")
def late_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("late") / "log"
    p = synth.SynthParams(bot_factor=2.0, action_log_rate=5.0)  # dense streams: late events overtake others
    synth.synth(str(out), days=2, users=30, items=2000, kinds=("lean", "actions"), arrivals=True, seed=1, params=p,
                log=io.StringIO())
    return trace_of_log(out, max_seq_len=20)


def _expected(trace) -> dict:
    """Per order, from the raw events: lookups that find the held state cut (invalidated) and the
    held events encoded again, for a cache that never evicts. Each user's requests in time order;
    the held view is the previous request's events, the current view this request's; the valid
    prefix is the whole held view when the current view starts with it, else the last page
    boundary at or before their first difference."""
    f = torch.stack([trace.ev_item, trace.ev_side[:, 0], trace.ev_side[:, 1], trace.ev_action], 1).numpy()
    t = trace.ev_time.numpy()
    out = {}
    for hold in ("arrival", "action_time"):
        inval = again = 0
        prev = {}
        for r in trace.order[0]:
            s, n = int(trace.req_sample[r]), int(trace.req_end[r])
            if n == 0:
                continue
            a = int(trace.seq_offsets[s])
            idx = a + (np.argsort(t[a:a + n], kind="stable") if hold == "action_time" else np.arange(n))
            view = [tuple(x) for x in f[idx].tolist()]
            if s in prev:
                held = prev[s]
                if view[:len(held)] != held:
                    j = next(i for i, (x, y) in enumerate(zip(view, held)) if x != y)
                    inval += 1
                    again += len(held) - j // P * P
            prev[s] = view
        out[hold] = {"invalidated": inval, "reencoded": again}
    return out


def test_the_replay_compares_arrival_order_with_action_time_order(late_trace):
    r = replay(late_trace, order="both", dtype="float64", dim=16, page_size=P, device="cpu", seed=0)
    o = r["orders"]
    want = _expected(late_trace)
    assert o["arrival"]["late_events"] > 0  # the log has late events that overtook others
    # arrival order: every request's events extend the held ones: never invalidated, nothing encoded again
    assert want["arrival"] == {"invalidated": 0, "reencoded": 0}
    assert o["arrival"]["invalidated"] == 0 and o["arrival"]["tokens"]["reencoded"] == 0
    assert o["arrival"]["partial_rate"] == 0
    # action-time order: each late event that lands before the held end cuts the state
    assert want["action_time"]["invalidated"] > 0
    assert o["action_time"]["invalidated"] == want["action_time"]["invalidated"]
    assert o["action_time"]["tokens"]["reencoded"] == want["action_time"]["reencoded"] > 0
    assert o["action_time"]["hit_rate"] < o["arrival"]["hit_rate"]
    assert o["action_time"]["tokens"]["new"] == o["arrival"]["tokens"]["new"]  # the same events, once each
    # in both, the cached logits equal the full recompute on every request (and the training forward in arrival)
    for hold in ("arrival", "action_time"):
        assert o[hold]["equality"]["equal"] and o[hold]["equality"]["over_tolerance"] == 0
        assert o[hold]["equality"]["max_abs_diff"] <= 1e-9 and o[hold]["requests"] == late_trace.num_requests
    eq = r["equality"]
    assert eq["equal"] and eq["over_tolerance_training"] == 0 and r["order"] == "both"
    # action-time order alone: the same numbers, its logits compared with the full recompute only
    a = replay(late_trace, order="action_time", dtype="float64", dim=16, page_size=P, device="cpu", seed=0)
    assert a["invalidated"] == o["action_time"]["invalidated"] and a["tokens"] == o["action_time"]["tokens"]
    assert a["equality"]["over_tolerance_training"] is None and a["equality"]["equal"]


def test_a_cache_that_ignores_the_insertion_is_caught(late_trace):
    """Held by action time, a store that serves the held state whole whenever its length fits
    (a chain-blind cache) serves K/V of another sequence: the replay sees it."""

    class Blind(KVStore):
        def acquire(self, user, chain, **kw):
            e = self._entries.get(self._key(user))
            if e is not None and e.chain.length <= chain.length:
                chain = type(chain)(e.chain.version, e.chain.block, e.chain.length, e.chain.checkpoints, e.chain.end)
                lease = super().acquire(user, chain, **kw)
                return lease
            return super().acquire(user, chain, **kw)

    r = replay(late_trace, order="both", dtype="float64", dim=16, page_size=P, device="cpu", seed=0,
               make_store=lambda node, **kw: Blind(**kw))
    assert r["orders"]["arrival"]["equality"]["equal"]  # arrival order appends: a blind cache is still right
    assert r["orders"]["action_time"]["equality"]["over_tolerance"] > 0 and not r["equality"]["equal"]


def test_without_late_events_both_orders_cost_the_same(tmp_path, capsys):
    shards = one_node_set(str(tmp_path / "S"))
    trace = read_trace(shards)
    assert trace.ev_time is not None
    argv = ["replay", "--shards", shards, "--dim", "16", "--order", "both", "--max-requests", "60", "--page-size", "8",
            "--json", "--quiet"]
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    a, t = r["orders"]["arrival"], r["orders"]["action_time"]
    assert a["late_events"] == 0
    assert (a["hit_rate"], a["invalidated"], a["tokens"]) == (t["hit_rate"], t["invalidated"], t["tokens"])
    assert cli.main(argv[:-2] + ["--quiet"]) == 0
    text = capsys.readouterr().out
    assert "order arrival: full reuse" in text and "order action_time: full reuse" in text


def test_bad_orders_are_refused(late_trace):
    with pytest.raises(ArgumentError, match="order='time'"):
        replay(late_trace, order="time")
    bare = late_trace.__class__(**{**late_trace.__dict__, "ev_time": None})
    with pytest.raises(UserwiseError, match="no action times"):
        replay(bare, order="action_time", device="cpu", dim=16)
    assert replay(bare, order="arrival", device="cpu", dim=16, max_requests=5)["order"] == "arrival"


def test_late_event_count_equals_a_loop_per_sample():
    """The replay's late-event count (one pass over all samples) equals counting sample by
    sample: events whose action time is below the largest before them in their own sample,
    with ties, empty samples and a sample's first event never counted."""
    from types import SimpleNamespace

    from userwise.pipelines.serve.build_replay import _late_events

    def by_loop(t, so):
        out = 0
        for a, b in zip(so[:-1], so[1:]):
            hi = None
            for v in t[a:b]:
                out += hi is not None and v < hi
                hi = v if hi is None else max(hi, v)
        return out

    rng = np.random.default_rng(7)
    seen = 0
    for _ in range(200):
        lens = rng.integers(0, 8, size=rng.integers(1, 20))
        so = np.concatenate([[0], np.cumsum(lens)])
        t = rng.integers(0, 5, size=int(so[-1])).astype(np.int64) * 10**12  # ties, epoch-sized times
        want = by_loop(t, so)
        seen += want
        assert _late_events(SimpleNamespace(ev_time=torch.from_numpy(t), seq_offsets=so)) == want
    assert seen > 0
