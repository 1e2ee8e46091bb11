"""The loader's state: what it records, what a loaded state must match, and the replay of
a saved run's consumed samples when the ranks or the batch size change mid-epoch.

A state (``UserwiseLoader.state_dict()``) is a small JSON-able dict::

    {"epoch": 1, "cursor": 7, "seed": 3, "samples": 52,            # where this rank is
     "node": 0, "rank": 1, "world_size": 2,                         # who saved it
     "batch_size": 8, "token_budget": None,                         # how batches are cut
     "shards": "3f1c0e9a7b2d4c11",                                  # the shard set (NodeShards.fingerprint)
     "plan": {"sets": [...], "split": "all", "shuffle": True, "buffer_row_groups": 2},
     "targets": [5, 3, 4],                                          # batches per set this epoch (cursor > 0)
     "resumed": [...]}                                              # only in an epoch resumed after a remap

``cursor`` counts the batches of the epoch handed out, ``samples`` the samples in them,
``targets`` the batches per selected set of the epoch's plan (after the cross-node
agreement). ``plan`` holds what else decides the plan: the sets, the split (with its
holdout when it is not ``"all"``), ``shuffle`` and ``buffer_row_groups`` (columns and
``batch_order`` do not change which samples a batch holds, so they may change freely).

The rules, checked when a state is loaded (:func:`accept`, a few comparisons) and when the
epoch is planned (:func:`check_plan`):

- the seed, the shard set, the node and ``plan`` must match, else :class:`LoaderStateError`;
- with the same world size, rank and batch size / token budget: the epoch resumes at
  ``cursor``, and the plan must give the first ``cursor`` batches ``samples`` samples and
  every set ``targets`` batches (else the plan changed: refused);
- a world size, batch size or token budget that differs: at an epoch's start (cursor 0)
  the epoch starts with the new settings; mid-epoch the state of every rank of the node
  is needed (the list ``dist.all_gather_object`` collects): the samples every old rank
  was handed in this epoch are skipped, exactly (the old plans are planned again from
  the footers, checked against each rank's ``samples`` and ``targets``), and the rest of
  the epoch's samples are planned for the new ranks (:func:`remaining`), with equal
  batch counts and the cross-node agreement as in any epoch. The state then carries the
  old run in ``resumed`` (one entry per change), so it resumes again, or changes again;
- a state lacking a field :meth:`state_dict` always saves is refused, naming it; ``{}`` (no
  checkpoint yet) starts at the beginning.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from userwise.pipelines.errors import LoaderStateError, expect
from userwise.pipelines.jagged import np_offsets
from userwise.pipelines.loader.planning.plan import PlanSettings, RankPlan, assign, plan_node

# ``cfg`` below is what decides the plan (:class:`~userwise.pipelines.loader.planning.plan.PlanSettings`); the
# one owner of the epochs, the cursor and the loaded state is :class:`~userwise.pipelines.loader.planning.epochs.Epochs`.

# What a saved run's consumed samples can be remapped across (by the samples consumed).
REMAPPED = ("world_size", "batch_size", "token_budget")
HOW = "pass the list of every rank's state (what dist.all_gather_object collects) to load_state_dict"


def selection(cfg: PlanSettings) -> dict:
    """What decides the plan besides the seed, the ranks and the batch cut."""
    sets = cfg.shards.sets
    out = {"sets": [sets[i] for i in cfg.set_idx], "split": cfg.split}
    if cfg.split != "all":
        out.update(eval_sets=[sets[i] for i in sorted(cfg.eval_set_idx)], eval_user_share=cfg.eval_user_share,
                   eval_seed=cfg.eval_seed)
    out.update(shuffle=cfg.shuffle, buffer_row_groups=cfg.buffer_row_groups)
    return out


def identity(cfg: PlanSettings) -> dict:
    """The part of a state that says which loader saved it."""
    return {"node": cfg.shards.node, "rank": cfg.rank, "world_size": cfg.world_size,
            "batch_size": None if cfg.token_budget is not None else int(cfg.batch_size),
            "token_budget": None if cfg.token_budget is None else int(cfg.token_budget),
            "shards": cfg.shards.fingerprint, "plan": selection(cfg)}


def targets_of(plan: RankPlan, set_idx) -> list[int]:
    """Batches per selected set of a rank's plan (equal on every rank of the epoch)."""
    n = dict.fromkeys(set_idx, 0)
    for b in plan.buffers:
        n[b.set_idx] += b.num_batches
    return [n[s] for s in set_idx]


def samples_before(plan: RankPlan, cursor: int) -> int:
    """Samples in the first ``cursor`` batches of a plan."""
    n = j = 0
    for b in plan.buffers:
        if j >= cursor:
            break
        k = min(b.num_batches, cursor - j)
        n += int(b.bounds[k] - b.bounds[0])
        j += b.num_batches
    return n


def _refuse(msg: str) -> LoaderStateError:
    return LoaderStateError(" ".join(f"loader state: {msg}".split()))


def _fmt(v) -> str:
    return "none" if v is None else repr(v) if isinstance(v, str) else str(v)


def _check_same_set(cfg: PlanSettings, st: Mapping, mine: dict) -> None:
    if "seed" in st and int(st["seed"]) != cfg.seed:
        raise _refuse(f"saved with seed {st['seed']}, this dataset has seed {cfg.seed}: resume with "
                      f"seed={st['seed']}, or start without load_state_dict")
    if st.get("shards") != mine["shards"]:
        raise _refuse(f"saved on shard set {st.get('shards')}, this loader reads {mine['shards']} "
                      f"({cfg.shards.root}): another or a changed shard set; resume on the set it was saved on, "
                      "or start this set without load_state_dict")
    if st.get("node") != mine["node"]:
        raise _refuse(f"saved by a rank of node {st.get('node')}, this loader reads node {mine['node']}: "
                      f"load the state of a rank of node {mine['node']}, or {HOW}")
    theirs = st.get("plan") or {}
    for k in [*mine["plan"], *(k for k in theirs if k not in mine["plan"])]:  # the first that differs
        if theirs.get(k) != mine["plan"].get(k):
            raise _refuse(f"saved with {k}={_fmt(theirs.get(k))}, this dataset has {k}={_fmt(mine['plan'].get(k))}: "
                          f"that changes which samples the epoch's batches hold; resume with {k}="
                          f"{_fmt(theirs.get(k))}, or start without load_state_dict")


# A state's fields and their kinds (:func:`~userwise.pipelines.errors.expect`); None allowed where marked.
FIELDS = {"epoch": ("int>=0", False), "cursor": ("int>=0", False), "seed": ("int", False),
          "samples": ("int>=0", False), "node": ("int>=0", False), "rank": ("int>=0", False),
          "world_size": ("int>=1", False), "batch_size": ("int>=1", True), "token_budget": ("int>=1", True),
          "shards": ("str", False), "plan": ("dict", False), "targets": ("list", True), "resumed": ("list", True)}
RUN_FIELDS = {"world_size": ("int>=1", False), "batch_size": ("int>=1", True), "token_budget": ("int>=1", True),
              "targets": ("list", False), "cursors": ("list", False), "samples": ("list", False)}
FIX = "pass what loader.state_dict() saved, unchanged"


def check_fields(st: Mapping, where: str = "loader state") -> None:
    """Every field a state holds is of its kind (:data:`FIELDS`), and so is every run in its
    ``resumed`` list; else :class:`LoaderStateError` naming the field."""
    for k, (kind, nullable) in FIELDS.items():
        if k in st:
            expect(st[k], kind, f"{where}: {k}", nullable=nullable, error=LoaderStateError, fix=FIX)
    for i, t in enumerate(st.get("targets") or ()):
        expect(t, "int>=0", f"{where}: targets[{i}]", error=LoaderStateError, fix=FIX)
    for i, run in enumerate(st.get("resumed") or ()):
        w = f"{where}: resumed[{i}]"
        expect(run, "dict", w, error=LoaderStateError, fix=FIX)
        for k, (kind, nullable) in RUN_FIELDS.items():
            if k not in run:
                raise _refuse(f"{w} lacks {k!r}; {FIX}")
            expect(run[k], kind, f"{w}.{k}", nullable=nullable, error=LoaderStateError, fix=FIX)
        if len(run["cursors"]) != run["world_size"] or len(run["samples"]) != run["world_size"]:
            raise _refuse(f"{w}: cursors and samples need one entry per rank of its world_size "
                          f"{run['world_size']}; {FIX}")
        for name, kind in (("targets", "int>=0"), ("cursors", "int>=0"), ("samples", "int")):
            for j, x in enumerate(run[name]):
                expect(x, kind, f"{w}.{name}[{j}]", error=LoaderStateError, fix=FIX)


# The fields every state that loader.state_dict() saves holds (``targets`` and ``resumed`` only when set).
REQUIRED = tuple(k for k in FIELDS if k not in ("targets", "resumed"))


def _check_complete(st: Mapping, where: str = "loader state") -> None:
    missing = [k for k in REQUIRED if k not in st]
    if missing:
        raise _refuse(f"{where} lacks {missing}: not a state that loader.state_dict() saved; {FIX}")


def _changed(st: Mapping, mine: dict) -> list[str]:
    return [f"{k} {_fmt(st.get(k))} -> {_fmt(mine[k])}" for k in REMAPPED if st.get(k) != mine[k]]


def accept(cfg: PlanSettings, state) -> dict:
    """Check a loaded state (one rank's dict, or a list of every rank's) against ``cfg`` and
    return this rank's state to resume from. Only compares fields (the plan is checked
    when the epoch is planned); raises :class:`LoaderStateError`."""
    if isinstance(state, (list, tuple)):
        for i, s in enumerate(state):
            if isinstance(s, Mapping):
                check_fields(s, f"loader state [{i}]")
        return _accept_all(cfg, list(state))
    if not isinstance(state, Mapping):
        raise _refuse(f"expected a dict (loader.state_dict()) or a list of every rank's, got {type(state).__name__}")
    unknown = sorted(set(state) - set(FIELDS))
    if unknown:
        raise _refuse(f"unknown fields {unknown}: not a state that loader.state_dict() saved; {FIX}")
    check_fields(state)
    if not state:
        return {"epoch": 0, "cursor": 0}
    _check_complete(state)
    mine = identity(cfg)
    _check_same_set(cfg, state, mine)
    changed = _changed(state, mine)
    if not changed:
        if state.get("rank") != cfg.rank:
            raise _refuse(f"saved by rank {state.get('rank')}, this is rank {cfg.rank} of node {mine['node']}: "
                          f"load this rank's own state, or {HOW}")
        return dict(state)
    if int(state["cursor"]) == 0:  # at the epoch's start: every rank of the job is (same batch counts)
        return _fresh(state)
    raise _refuse(f"{', '.join(changed)} mid-epoch (epoch {state['epoch']}, batch {state['cursor']}): one rank's "
                  f"state does not say what the others consumed; {HOW}, or resume with the saved settings")


def _fresh(st: Mapping) -> dict:
    """The start of ``st``'s epoch (or of what is left of it after the runs in ``resumed``)."""
    out = {"epoch": int(st["epoch"]), "cursor": 0, "samples": 0}
    if st.get("resumed"):
        out["resumed"] = list(st["resumed"])
    return out


def _accept_all(cfg: PlanSettings, states: list) -> dict:
    if not states or not all(isinstance(s, Mapping) for s in states):
        raise _refuse("a list of states needs every rank's state as loader.state_dict() saves it")
    for i, s in enumerate(states):
        _check_complete(s, f"loader state [{i}]")
    mine = identity(cfg)
    here = [s for s in states if s.get("node") == mine["node"]]
    if not here:
        raise _refuse(f"none of the {len(states)} states is of node {mine['node']} (they are of nodes "
                      f"{sorted({s.get('node') for s in states})}): load the states saved on this shard set's "
                      f"node {mine['node']}")
    first = here[0]
    _check_same_set(cfg, first, mine)
    for k in ("epoch", "seed", "shards", "plan", *REMAPPED, "resumed"):
        vals = {repr(s.get(k)) for s in here}
        if len(vals) > 1:
            raise _refuse(f"the states of node {mine['node']} differ in {k} ({', '.join(sorted(vals))}): they are "
                          "not of one checkpoint; pass the states every rank saved at the same step")
    world = int(first["world_size"])
    ranks = sorted(int(s["rank"]) for s in here)
    if ranks != list(range(world)):
        raise _refuse(f"node {mine['node']} saved {world} ranks' states, the list holds ranks {ranks}: pass every "
                      "rank's state exactly once")
    by_rank = {int(s["rank"]): s for s in here}
    if not _changed(first, mine):
        return dict(by_rank[cfg.rank])
    cursors = [int(by_rank[r]["cursor"]) for r in range(world)]
    if not any(cursors):
        return _fresh(first)
    targets = {repr(s["targets"]) for s in here if s.get("targets") is not None}
    if len(targets) != 1 or any(c and by_rank[r].get("targets") is None for r, c in enumerate(cursors)):
        raise _refuse(f"the states of node {mine['node']} do not agree on the epoch's batches per set "
                      f"({', '.join(sorted(targets)) or 'none saved'}): pass the states every rank saved at the same step")
    seg = {k: first[k] for k in REMAPPED}
    seg.update(targets=[int(x) for x in next(s["targets"] for s in here if s.get("targets") is not None)],
               cursors=cursors, samples=[int(by_rank[r].get("samples", -1)) for r in range(world)])
    return {"epoch": int(first["epoch"]), "cursor": 0, "samples": 0, "resumed": [*first.get("resumed", []), seg]}


def check_plan(cfg: PlanSettings, plan: RankPlan, st: Mapping) -> None:
    """The epoch's plan gives the loaded state's first ``cursor`` batches ``samples`` samples
    and each set ``targets`` batches; else the saved run's plan cannot be reproduced."""
    cursor = int(st.get("cursor", 0))
    if cursor > plan.num_batches:
        raise _refuse(f"cursor {cursor} is past the {plan.num_batches} batches this loader plans for epoch "
                      f"{plan.epoch}: the state is of another shard set, selection or batch size; resume as it was "
                      "saved, or start the epoch again (loader.set_epoch)")
    if "samples" in st and cursor and samples_before(plan, cursor) != int(st["samples"]):
        raise _refuse(f"this loader plans {samples_before(plan, cursor)} samples into the first {cursor} batches "
                      f"of epoch {plan.epoch}, the saved run had {st['samples']}: the plan differs (another "
                      "all_reduce_targets, other nodes' sets, or another loader version); resume as the state was "
                      "saved, or start the epoch again (loader.set_epoch)")
    if st.get("targets") is not None and cursor and targets_of(plan, cfg.set_idx) != list(st["targets"]):
        raise _refuse(f"this loader plans {targets_of(plan, cfg.set_idx)} batches per set for epoch {plan.epoch}, "
                      f"the saved run had {list(st['targets'])}: the plan differs (another all_reduce_targets, "
                      "other nodes' sets, or another loader version); resume as the state was saved, or start "
                      "the epoch again (loader.set_epoch)")


def _rows_in(plan: RankPlan, cursor: int, rg_rows: np.ndarray):
    """(row group, row in it) of every sample in the first ``cursor`` batches of ``plan``."""
    j = 0
    for b in plan.buffers:
        if j >= cursor:
            return
        k = min(b.num_batches, cursor - j)
        rows = b.perm[int(b.bounds[0]): int(b.bounds[k])]
        base = np_offsets(rg_rows[b.rgs])
        which = np.searchsorted(base, rows, side="right") - 1
        yield b.rgs[which], rows - base[which]
        j += b.num_batches


def remaining(cfg: PlanSettings, epoch: int, segments: list, keep: list) -> list:
    """``keep`` (per row group: None or a mask of kept rows) without the samples the runs in
    ``segments`` consumed in ``epoch``: each segment's plans are made again as that run made
    them (its world size, batch cut and agreed batches per set, every earlier segment's
    samples already out), and the first ``cursors[r]`` batches of each of its ranks come out."""
    sh = cfg.shards
    left = [np.ones(int(n), bool) if k is None else np.array(k, bool) for k, n in zip(keep, sh.rg_rows)]
    for seg in segments:
        world, budget = int(seg["world_size"]), seg["token_budget"]
        costs = sh.column("cost") if budget is not None else None
        weight = sh.rg_rows if budget is None else np.array([c.sum() for c in costs])
        owner = assign(sh.rg_set, sh.rg_rank, weight, int(sh.manifest["ranks_per_node"]), world)
        want = dict(zip(cfg.set_idx, (int(t) for t in seg["targets"])))
        plans, got = plan_node(rg_rows=sh.rg_rows, rg_set=sh.rg_set, rg_owner=owner, keep=left, costs=costs,
                               sets=cfg.set_idx, world=world, epoch=epoch, seed=cfg.seed, shuffle=cfg.shuffle,
                               batch_order="shuffled", buffer_rgs=cfg.buffer_row_groups, batch_size=seg["batch_size"],
                               token_budget=budget, targets=want)  # the order inside a batch does not matter here
        if got != want:
            raise _refuse(f"the run saved with world_size {world} planned {list(want.values())} batches per set for "
                          f"epoch {epoch}, this node's shards give {list(got.values())}: the plan cannot be made "
                          "again; resume as the state was saved, or start the epoch again (loader.set_epoch)")
        for r, cursor in enumerate(seg["cursors"]):
            n = 0
            for rgs, rows in _rows_in(plans[r], int(cursor), sh.rg_rows):
                for g in np.unique(rgs):
                    left[int(g)][rows[rgs == g]] = False
                n += len(rows)
            if int(seg["samples"][r]) not in (-1, n):
                raise _refuse(f"rank {r} of the run saved with world_size {world} was handed {seg['samples'][r]} "
                              f"samples in epoch {epoch}, its plan made again gives {n}: the plan cannot be made "
                              "again; resume as the state was saved, or start the epoch again (loader.set_epoch)")
    return left
