"""A user with 100K events and requests at L = 16,000 pre-shards, stages, loads and serves,
in bounded memory, without Spark (issue #56, point 3). The Spark half, the real build and
preshard of a log with such a user on the default local Spark, then stage, load and serve, is
tests/builder/test_long_user_build.py.

The sample is :func:`~userwise.pipelines.tools.shardgen.long_user_samples`: one chunk of
100,000 stored events whose 8 requests are spread over the history (the last sees events
84,000-100,000), beside 3 light users. It goes through
:func:`~userwise.pipelines.shards.preshard.preshard_arrow`, :func:`~userwise.pipelines.shards.stage.stage`
and a :class:`~userwise.pipelines.loader.UserwiseLoader` (one worker; a token budget that fits the
sample, so no notice), and every request is served in time order through a
:class:`~userwise.pipelines.serve.KVStore` in pages of 64 (a prefill, then extends by the events
since the last request) with a one-layer window encoder of dim 16; each request's cached logits
equal the full recompute (the training forward over the same events) to float32 rounding.

Measured memory (the flow in a fresh process, on the shared 2-core development machine, torch
CPU, one thread; VmHWM, see tests/support/memory.py): peak RSS 1.02 GB, of which 0.58 GB is the
imports (torch, pyarrow, numba) and 0.44 GB the flow. The largest part is the full recompute at
100K events: the training forward's block attention, chunked (at most ``CHUNK_ELEMS`` scores at
once), linear in the events (no requests x L anywhere). The store holds the user in 25.6 MB (1,563 pages
x 64 events x 4 slots x 16 dims x 4 bytes). The test asserts the flow's growth stays under
2 GB; it runs in about 13 s (a fresh process), hence ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BOUND_GROWTH_MB = 2048  # generous: measured 0.44 GB (see the module doc)
EVENTS, L, PAGE = 100_000, 16_000, 64


def flow(tmp: str) -> dict:
    """Generate, pre-shard, stage, load and serve the heavy user; return what the test checks."""
    import io

    import numpy as np
    import torch

    from tests.support.memory import peak_mb
    from tests.support.serving import serve_and_recompute
    from userwise import schemas
    from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
    from userwise.pipelines.serve import Candidates, Events, KVStore, chain_of
    from userwise.pipelines.shards import preshard, stage
    from userwise.pipelines.tools.shardgen import HEAVY, layout, long_user_samples
    from userwise.pipelines.train import ReferenceRanker, UserBatch

    torch.set_num_threads(1)
    base_mb = peak_mb()
    out: dict = {"base_mb": base_mb}

    table = long_user_samples(events=EVENTS, max_seq_len=L, requests=8, light=3, seed=5)
    users = table.column("user").to_pylist()
    heavy = table.slice(users.index(HEAVY), 1).to_pylist()[0]
    out["stored_events"] = heavy["num_events"]
    out["pointers_ok"] = heavy["req_seq_begin"] == [max(0, e - L) for e in heavy["req_seq_end"]]

    shards, staged = os.path.join(tmp, "S"), os.path.join(tmp, "staged")
    preshard.preshard_arrow(table, shards, schema=schemas.shard_schema(layout()).to_arrow(), nodes=1,
                            ranks_per_node=1)
    stage.stage(shards, 0, staged, out=io.StringIO())

    ds = UserwiseDataset(staged, token_budget=int(heavy["cost"]), world_size=1, rank=0, device="cpu")
    got_ids, hb = [], None
    for b in UserwiseLoader(ds, num_workers=1, zero_copy=False):
        got_ids += b.numpy("sample_id").tolist()
        if HEAVY in b.numpy("user").tolist():
            hb = b
    out["delivered_once"] = sorted(got_ids) == sorted(table.column("sample_id").to_pylist())

    ub = UserBatch.from_jagged(hb)
    sp = ub.spans
    i = hb.numpy("user").tolist().index(HEAVY)
    a, z = int(sp.seq_offsets[i]), int(sp.seq_offsets[i + 1])
    events = Events(ub.ev_item[a:z], ub.ev_side[a:z], ub.ev_action[a:z])
    out["loaded_events_equal"] = (len(events) == EVENTS
                                  and events.item.tolist() == heavy["seq_item"]
                                  and events.action.tolist() == heavy["seq_action"])
    # the build's chain of the stored events (the sample's chain columns) is the chain serving makes
    full_chain = chain_of(events, block=PAGE, version="v")
    co = hb.numpy("chain_checkpoints.offsets")
    out["chain_equal"] = (np.array_equal(full_chain.checkpoints, hb.numpy("chain_checkpoints")[co[i]:co[i + 1]])
                          and int(full_chain.end) == int(hb.numpy("chain_end")[i]))

    torch.manual_seed(0)
    model = ReferenceRanker(dim=16, heads=2, layers=1, encoder="window", window=64).eval()
    store = KVStore(page_size=PAGE, device_bytes=64 << 20, device="cpu", max_seq_len=L)
    reqs = [r for r in range(sp.num_requests) if int(sp.req_sample[r]) == i]
    worst, lengths, served_from = 0.0, [], []
    for r in reqs:  # in time order: the stored requests are
        end = int(sp.req_end[r]) - a
        mask = sp.imp_req == r
        cands = Candidates(ub.tgt_item[mask], ub.tgt_side[mask])
        cur = events[:end]
        cached, ref, held = serve_and_recompute(store, model, HEAVY, cur, cands, max_seq_len=L, page_size=PAGE)
        served_from.append(held)
        worst = max(worst, float((cached - ref).abs().max() / ref.abs().max().clamp(min=1e-6)))
        lengths.append(end)
    store.check()
    s = store.stats()
    out.update(worst_rel=worst, lengths=lengths, served_from=served_from, reuse=s["reuse"],
               resident=s["resident_bytes"]["device"], user_bytes=store.user_bytes(EVENTS, "device"),
               peak_mb=peak_mb())
    return out


@pytest.mark.slow
def test_a_user_with_100k_events_at_l_16000_preshards_stages_loads_and_serves(tmp_path):
    code = ("import json, sys; from tests.serve.test_long_user import flow; "
            "print(json.dumps(flow(sys.argv[1])))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=root,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stored_events"] == EVENTS and out["pointers_ok"]
    assert out["delivered_once"] and out["loaded_events_equal"] and out["chain_equal"]
    assert "token_budget" not in r.stderr  # the budget fits the sample: no oversize notice
    assert out["lengths"][-1] == EVENTS and out["lengths"] == sorted(out["lengths"]) and len(out["lengths"]) == 8
    # a prefill, then every request extends the state the store held for the one before
    assert out["served_from"] == [0] + out["lengths"][:-1]
    assert out["reuse"]["miss"] == 1 and out["reuse"]["full"] == 7
    assert out["worst_rel"] < 1e-5  # cached equals recompute (float32)
    assert out["resident"] == out["user_bytes"] == -(-EVENTS // PAGE) * PAGE * 4 * 16 * 4  # pages x slots x dim
    growth = out["peak_mb"] - out["base_mb"]
    assert growth < BOUND_GROWTH_MB, f"the flow took {growth:.0f} MB over its imports' {out['base_mb']:.0f} MB"
