"""The loader's state: what it records, what it refuses, and the exact remap of a mid-epoch
change of world size or batch cut by the samples every old rank consumed (resume.py)."""

from __future__ import annotations

import collections
import json

import pytest

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.loader.planning.epochs import Epochs
from userwise.pipelines.loader.planning.resume import LoaderStateError
from userwise.pipelines.shards import manifest as mf
from userwise.pipelines.tools.shardgen import all_rows, write_shard_set

KW = dict(verify="none", seed=3, device="cpu")


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shards"))
    write_shard_set(root, nodes=1, ranks_per_node=2, row_group_rows=8)
    return root


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("two"))
    write_shard_set(root, nodes=2, ranks_per_node=2, row_group_rows=8)
    return root


def loader(root, rank, world, workers=0, **kw):
    return UserwiseLoader(UserwiseDataset(root, rank=rank, world_size=world, **{**KW, "batch_size": 8, **kw}),
                          num_workers=workers)


def ids(ld, n=None) -> list[list[int]]:
    """sample_ids per batch, for at most ``n`` batches (the loader stays where it stopped)."""
    out = []
    it = iter(ld)
    for b in it:
        out.append(b.numpy("sample_id").tolist())
        if n is not None and len(out) == n:
            it.close()
            break
    return out


def saved(ld) -> dict:
    """A state as a checkpoint holds it: through JSON."""
    return json.loads(json.dumps(ld.state_dict()))


def everything(root) -> collections.Counter:
    return collections.Counter(all_rows(root).column("sample_id").to_pylist())


def test_the_state_records_what_it_depends_on(shardset):
    ld = loader(shardset, 1, 2)
    head = ids(ld, 3)
    st = saved(ld)
    assert st["epoch"] == 0 and st["cursor"] == 3 and st["samples"] == sum(map(len, head))
    assert (st["node"], st["rank"], st["world_size"], st["batch_size"], st["token_budget"]) == (0, 1, 2, 8, None)
    assert st["shards"] == ld.dataset.epochs.settings.shards.fingerprint and len(st["shards"]) == 16
    assert st["plan"] == {"sets": [s["id"] for s in mf.load(shardset)["sets"]], "split": "all", "shuffle": True,
                          "buffer_row_groups": ld.dataset.buffer_row_groups}
    assert len(st["targets"]) == 3 and sum(st["targets"]) == len(ld)
    assert len(json.dumps(st)) < 600  # small
    tb = saved(loader(shardset, 0, 1, token_budget=150))
    assert (tb["batch_size"], tb["token_budget"]) == (None, 150) and "targets" not in tb  # nothing handed out yet


def _refused(ld, state, *words):
    with pytest.raises(LoaderStateError) as e:
        ld.load_state_dict(state)
    msg = str(e.value)
    assert isinstance(e.value, UserwiseError) and isinstance(e.value, ValueError)
    assert "\n" not in msg and msg.startswith("loader state: ")
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("change,words", [
    ({"seed": 4}, ("seed 3", "seed 4")),
    ({"sets": ["incremental"]}, ("sets=",)),
    ({"split": "train", "eval_user_share": 0.2}, ("split=",)),
    ({"shuffle": False}, ("shuffle=True",)),
    ({"buffer_row_groups": 3}, ("buffer_row_groups=",)),
])
def test_a_state_of_another_selection_is_refused_in_one_line(shardset, change, words):
    ld = loader(shardset, 0, 2)
    ids(ld, 2)
    st = saved(ld)
    _refused(loader(shardset, 0, 2, **change), st, *words, "load_state_dict")


def test_a_state_of_another_shard_set_node_or_rank_is_refused(shardset, two_nodes, tmp_path):
    ld = loader(shardset, 0, 2)
    ids(ld, 2)
    st = saved(ld)
    other = str(tmp_path / "other")
    write_shard_set(other, nodes=1, ranks_per_node=2, row_group_rows=8, seed=1)  # same shape, other samples
    _refused(loader(other, 0, 2), st, "shard set", st["shards"])
    _refused(loader(shardset, 1, 2), st, "rank 0", "this is rank 1")
    n0 = UserwiseLoader(UserwiseDataset(two_nodes, node=0, rank=0, world_size=2, batch_size=8, **KW))
    ids(n0, 1)
    _refused(UserwiseLoader(UserwiseDataset(two_nodes, node=1, rank=0, world_size=2, batch_size=8, **KW)),
             saved(n0), "node 0", "node 1")
    _refused(ld, [{"epoch": 0, "cursor": 1, "seed": 3}], "world_size")  # states that carry no rank
    _refused(ld, "epoch 3", "dict")


def test_a_state_lacking_a_saved_field_is_refused_and_none_starts_at_the_beginning(shardset):
    """Only what state_dict() saves resumes: ``{epoch, cursor, seed}`` says neither the shard
    set nor the rank, so it is refused naming what it lacks; ``{}`` (no checkpoint yet) starts."""
    want = ids(loader(shardset, 0, 2))
    _refused(loader(shardset, 0, 2), {"epoch": 0, "cursor": 4, "seed": 3}, "lacks", "'world_size'", "'shards'")
    st = saved(loader(shardset, 0, 2))
    del st["plan"]
    _refused(loader(shardset, 0, 2), st, "lacks ['plan']")
    fresh = loader(shardset, 0, 2)
    fresh.load_state_dict({})  # no checkpoint yet: ckpt.get("loader", {})
    assert ids(fresh) == want


def test_loading_only_compares_and_the_plan_is_checked_at_the_next_iteration(shardset, monkeypatch):
    ld = loader(shardset, 0, 2)
    ids(ld, 3)
    st = saved(ld)
    calls = []
    real = Epochs.rank_plans
    monkeypatch.setattr(Epochs, "rank_plans", lambda self, epoch=None: calls.append(epoch) or real(self, epoch))
    again = loader(shardset, 0, 2)
    again.load_state_dict(st)
    assert calls == []  # cheap: no plan made
    for bad, word in (({"samples": st["samples"] + 1}, "samples"), ({"targets": [t + 1 for t in st["targets"]]}, "per set")):
        wrong = loader(shardset, 0, 2)
        wrong.load_state_dict({**st, **bad})
        with pytest.raises(LoaderStateError, match=word):
            ids(wrong)


def _old_run(root, world, cursors, **kw):
    """``world`` ranks each handed ``cursors[r]`` batches of epoch 1: what they consumed, their states."""
    seen, states = collections.Counter(), []
    for r in range(world):
        ld = loader(root, r, world, **kw)
        ld.set_epoch(1)
        for b in ids(ld, cursors[r]) if cursors[r] else []:
            seen.update(b)
        states.append(saved(ld))
    return seen, states


@pytest.mark.parametrize("old,new,cursors,before,after,workers", [
    (4, 2, [3, 3, 3, 3], {}, {}, 0),                       # half the ranks, in step
    (2, 3, [2, 5], {"token_budget": 150}, {"token_budget": 150}, 1),  # more ranks, token budget, not in step
    (2, 2, [4, 4], {}, {"batch_size": 5}, 0),               # another batch size
    (2, 1, [1, 6], {"batch_size": 6}, {"token_budget": 120}, 0),  # a count cut to a token budget
])
def test_a_change_mid_epoch_resumes_every_sample_exactly_once(shardset, old, new, cursors, before, after, workers):
    seen, states = _old_run(shardset, old, cursors, **before)
    assert sum(seen.values()) and max(seen.values()) == 1
    counts = []
    for r in range(new):
        ld = loader(shardset, r, new, workers, **after)
        ld.load_state_dict(states)
        st = ld.state_dict()
        assert (st["epoch"], st["cursor"], st["world_size"]) == (1, 0, new)
        assert st["resumed"] == [{"world_size": old, "batch_size": states[0]["batch_size"],
                                  "token_budget": states[0]["token_budget"], "targets": states[0]["targets"],
                                  "cursors": cursors, "samples": [s["samples"] for s in states]}]
        rest = ids(ld)
        counts.append(len(rest))
        for b in rest:
            seen.update(b)
        # the next epoch is a whole one, as a fresh loader of the new ranks plans it
        assert ld.state_dict()["epoch"] == 2 and "resumed" not in ld.state_dict()
        nxt = loader(shardset, r, new, **after)
        nxt.set_epoch(2)
        assert ids(ld, 3) == ids(nxt, 3)
    assert seen == everything(shardset)  # the old run's part and the new run's: the epoch, once
    assert len(set(counts)) == 1  # equal batch counts on the new ranks


def test_a_remapped_epoch_resumes_and_changes_again(shardset):
    seen, states = _old_run(shardset, 4, [2, 2, 2, 2])
    mid = []
    for r in range(2):  # 4 -> 2 ranks, two batches each, then stopped
        ld = loader(shardset, r, 2, batch_size=6)
        ld.load_state_dict(states)
        rest = ids(ld)
        ld2 = loader(shardset, r, 2, batch_size=6)
        ld2.load_state_dict(states)
        head = ids(ld2, 2)
        for b in head:
            seen.update(b)
        st = saved(ld2)
        assert st["cursor"] == 2 and len(st["resumed"]) == 1
        same = loader(shardset, r, 2, batch_size=6)  # a plain resume inside the remapped epoch
        same.load_state_dict(st)
        assert ids(same) == rest[2:]
        mid.append(st)
    counts = []
    for r in range(3):  # 2 -> 3 ranks
        ld = loader(shardset, r, 3)
        ld.load_state_dict(mid)
        assert len(ld.state_dict()["resumed"]) == 2
        rest = ids(ld)
        counts.append(len(rest))
        for b in rest:
            seen.update(b)
    assert seen == everything(shardset) and len(set(counts)) == 1


def test_one_state_changes_world_only_at_an_epoch_start(shardset):
    _, states = _old_run(shardset, 2, [3, 3])
    msg = _refused(loader(shardset, 0, 4), states[0], "world_size 2 -> 4", "list of every rank's state")
    assert "mid-epoch" in msg
    done = loader(shardset, 0, 2)
    ids(done)  # a whole epoch: the state is at the next one's start
    st = saved(done)
    assert (st["epoch"], st["cursor"]) == (1, 0)
    for r in range(4):
        ld = loader(shardset, r, 4)
        ld.load_state_dict(st)
        fresh = loader(shardset, r, 4)
        fresh.set_epoch(1)
        assert ids(ld) == ids(fresh)


def test_a_list_of_states_is_one_checkpoint_of_every_rank(shardset, two_nodes):
    _, states = _old_run(shardset, 2, [3, 3])
    ld = loader(shardset, 0, 4)
    _refused(ld, states[:1], "ranks [0]")
    _refused(ld, [states[0], states[0]], "ranks [0, 0]")
    _, later = _old_run(shardset, 2, [3, 5])
    _refused(ld, [states[0], dict(later[1], epoch=2)], "differ in epoch")
    # with the same settings the list gives each rank its own state; other nodes' states are left alone
    both = []
    for node in (0, 1):
        for r in range(2):
            x = UserwiseLoader(UserwiseDataset(two_nodes, node=node, rank=r, world_size=2, batch_size=8, **KW))
            ids(x, 2 + r)
            both.append(saved(x))
    for node in (0, 1):
        for r in range(2):
            x = UserwiseLoader(UserwiseDataset(two_nodes, node=node, rank=r, world_size=2, batch_size=8, **KW))
            x.load_state_dict(both)
            assert x.state_dict()["cursor"] == 2 + r and x.state_dict()["node"] == node
