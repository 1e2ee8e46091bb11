"""One rank's epochs: the one owner of the epoch plan, the plan made ahead, the cursor and resume.

:class:`Epochs` plans this rank's epochs from a dataset's
:class:`~userwise.pipelines.loader.planning.plan.PlanSettings` (:func:`~userwise.pipelines.loader.planning.plan.plan_node`,
with the holdout, the cross-node agreement of :mod:`distributed` and what a resumed state already
consumed, :mod:`resume`), keeps the current epoch's plan and one made ahead, and knows where the
iteration is: the epoch, the cursor (batches handed out), the samples in them, and a loaded state
still to be checked against the plan. :class:`~userwise.pipelines.loader.UserwiseDataset` holds one
(``dataset.epochs``); :class:`~userwise.pipelines.loader.UserwiseLoader` drives it through
:meth:`Epochs.begin`, :meth:`Epochs.handed` and :meth:`Epochs.finish`, and saves and loads it
(:meth:`Epochs.state_dict`, :meth:`Epochs.load_state_dict`).
"""

from __future__ import annotations

import numpy as np

from userwise.pipelines.loader.logs import say_once
from userwise.pipelines.loader.planning import distributed, resume
from userwise.pipelines.loader.planning.plan import PlanSettings, RankPlan, assign, holdout, oversize, plan_node

__all__ = ["Epochs"]


class Epochs:
    """This rank's epochs over one node's shards: plans, the position in them, and resume.

    Example::

        ep = dataset.epochs
        plan = ep.plan()                  # this rank's plan of the current epoch (cached)
        ep.plan_ahead(ep.epoch + 1)       # and the next one, made while the workers read
        plan, start = ep.begin()          # iterate: the plan, checked against a loaded state
        ep.handed(start, 16)              # batch `start` (16 samples) went out
        state = ep.state_dict()           # {"epoch", "cursor", "seed", "samples", ...}
    """

    def __init__(self, settings: PlanSettings):
        self.settings = settings
        self._epoch = 0
        self._cursor = 0  # batches of the epoch handed out
        self._samples = 0  # samples in them (the state's "samples")
        self._targets: list | None = None  # batches per set of this epoch's plan, once known
        self._loaded: dict | None = None  # a loaded state, checked against the plan when the epoch is planned
        self._plans: dict[int, RankPlan] = {}  # this rank's plans by epoch: the current one, one made ahead
        self._resumed: tuple[int, list] | None = None  # (epoch, the runs that consumed part of it: resume.py)
        self._owner: np.ndarray | None = None  # the rank of every row group
        self._keep: list | None = None  # per row group, the rows the split keeps
        self._told_oversize = False  # the samples over the token budget counted (and said, if any)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration plans."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Batches of the epoch already handed out (the next iteration starts there)."""
        return self._cursor

    # -- plans -------------------------------------------------------------------
    def rank_plans(self, epoch: int | None = None) -> list[RankPlan]:
        """Plans of every rank of this node for ``epoch`` (default the current one), made now."""
        cfg = self.settings
        epoch = self._epoch if epoch is None else int(epoch)
        sh = cfg.shards
        weight = sh.rg_rows if cfg.token_budget is None else np.array([c.sum() for c in sh.column("cost")])
        if self._owner is None:
            self._owner = assign(sh.rg_set, sh.rg_rank, weight, int(sh.manifest["ranks_per_node"]), cfg.world_size)
        if self._keep is None:
            self._keep = holdout(sh.rg_rows, sh.rg_set, split=cfg.split, eval_set_idx=cfg.eval_set_idx,
                                 eval_user_share=cfg.eval_user_share, eval_seed=cfg.eval_seed,
                                 users=sh.column("user") if cfg.split != "all" and cfg.eval_user_share > 0 else None)
        costs = sh.column("cost") if cfg.token_budget is not None else None
        if costs is not None and not self._told_oversize:
            self._told_oversize = True
            self._tell_oversize(costs)
        keep = self._keep
        if self._resumed is not None and self._resumed[0] == epoch:  # what the saved runs left of the epoch
            keep = resume.remaining(cfg, epoch, self._resumed[1], keep)
        kw = dict(rg_rows=sh.rg_rows, rg_set=sh.rg_set, rg_owner=self._owner, keep=keep, costs=costs,
                  sets=cfg.set_idx, world=cfg.world_size, epoch=epoch, seed=cfg.seed, shuffle=cfg.shuffle,
                  batch_order=cfg.batch_order, buffer_rgs=cfg.buffer_row_groups, batch_size=cfg.batch_size,
                  token_budget=cfg.token_budget)
        plans, targets = plan_node(**kw)
        agreed = self.agreed_targets(targets)
        if agreed != targets:
            plans, _ = plan_node(**kw, targets=agreed)
        return plans

    def _tell_oversize(self, costs: list) -> None:
        """Say once per process how many of the node's samples cost more than the token
        budget: each is a batch of its own (:func:`~userwise.pipelines.loader.planning.plan.cut`),
        never dropped, and such a batch is over the budget."""
        budget = self.settings.token_budget
        over, total, largest = oversize(costs, self._keep, budget)
        if over:
            say_once(f"userwise loader: {over} of {total} samples on this node cost more than "
                     f"token_budget={budget} (the largest {largest} events + impressions); each is "
                     "a batch of its own, over the budget; raise token_budget to at least "
                     f"{largest} to keep every batch within it")

    def spans_nodes(self) -> bool:
        """Planning an epoch takes one all-reduce (:func:`distributed.spans_nodes`)."""
        return distributed.spans_nodes(self.settings.world_size, self.settings.all_reduce_targets)

    def agreed_targets(self, targets: dict) -> dict:
        """The batches per set every rank of the job agrees on: this node's, or with
        :meth:`spans_nodes` the max over all nodes (:func:`distributed.agree_targets`)."""
        if not self.spans_nodes():
            return targets
        return distributed.agree_targets({s: targets[s] for s in self.settings.set_idx})

    def plan(self, epoch: int | None = None) -> RankPlan:
        """This rank's plan of ``epoch`` (default the current one; cached per epoch, and a plan
        made ahead for the next epoch is kept)."""
        epoch = self._epoch if epoch is None else int(epoch)
        p = self._plans.get(epoch)
        if p is None:
            p = self._keep_plan(epoch, self.rank_plans(epoch)[self.settings.rank])
        return p

    def plan_ahead(self, epoch: int) -> bool:
        """Plan ``epoch`` now and keep it with the current one: the loader calls this for the
        next epoch while its workers read their first buffers, so the next epoch does not
        start with the trainer planning and every worker waiting.
        Not where planning takes a collective (ranks on other nodes must plan at the same
        point in their programs). Returns whether the plan is ready."""
        epoch = int(epoch)
        if epoch not in self._plans:
            if self.spans_nodes():
                return False
            self._keep_plan(epoch, self.rank_plans(epoch)[self.settings.rank])
        return True

    def _keep_plan(self, epoch: int, plan: RankPlan) -> RankPlan:
        """Cache ``plan``, with the plans of the epochs next to it (the current one, or one
        made ahead) and no others."""
        self._plans = {e: q for e, q in self._plans.items() if abs(e - epoch) == 1}
        self._plans[epoch] = plan
        return plan

    # -- position ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (a new seeded shuffle per epoch): a loaded state
        not yet iterated is dropped."""
        self._epoch, self._cursor = int(epoch), 0
        self._samples, self._targets, self._loaded = 0, None, None
        self._set_resumed(self._epoch, None)

    def begin(self) -> tuple[RankPlan, int]:
        """An iteration starts: the current epoch's plan (a loaded state's first ``cursor``
        batches checked against it: the saved run's plan, made again) and the first batch to
        hand out. Raises :class:`~userwise.pipelines.loader.planning.resume.LoaderStateError` when the
        plan cannot reproduce the loaded state."""
        plan = self.plan()
        if self._loaded is not None:
            resume.check_plan(self.settings, plan, self._loaded)
            self._loaded = None
        self._targets = resume.targets_of(plan, self.settings.set_idx)
        self._samples = resume.samples_before(plan, self._cursor)
        return plan, self._cursor

    def handed(self, index: int, num_samples: int) -> None:
        """Batch ``index`` of the epoch, of ``num_samples`` samples, went out."""
        self._cursor = int(index) + 1
        self._samples += int(num_samples)

    def finish(self) -> None:
        """The epoch ran out: the next iteration starts the next epoch at its first batch."""
        self._epoch, self._cursor, self._samples, self._targets = self._epoch + 1, 0, 0, None
        self._set_resumed(self._epoch, None)

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this rank is and what that depends on (:mod:`resume`; docs/loader.md, Resuming)."""
        cfg = self.settings
        st = {"epoch": self._epoch, "cursor": self._cursor, "seed": cfg.seed, "samples": self._samples,
              **resume.identity(cfg)}
        if self._cursor and self._targets is not None:
            st["targets"] = list(self._targets)
        runs = self._runs_resumed(self._epoch)
        if runs:
            st["resumed"] = runs
        return st

    def load_state_dict(self, state) -> None:
        """Queue a state for the next iteration: this rank's :meth:`state_dict`, or the list of
        every rank's. Its fields are checked now (:func:`resume.accept`, a few comparisons);
        the plan is checked when the epoch begins (:meth:`begin`)."""
        st = resume.accept(self.settings, state)
        self._epoch, self._cursor = int(st.get("epoch", 0)), int(st.get("cursor", 0))
        self._samples = int(st.get("samples", 0))
        self._targets = st.get("targets")
        self._loaded = st if self._cursor else None
        self._set_resumed(self._epoch, st.get("resumed"))

    def _set_resumed(self, epoch: int, runs: list | None) -> None:
        """Plan ``epoch`` without the samples that the saved runs ``runs`` consumed in it
        (:func:`resume.remaining`; none: the whole epoch). Drops the plans made for the
        epochs this changes."""
        new = (int(epoch), list(runs)) if runs else None
        if new == self._resumed:
            return
        stale = {e for e in (epoch, self._resumed and self._resumed[0]) if e is not None}
        self._plans = {e: p for e, p in self._plans.items() if e not in stale}
        self._resumed = new

    def _runs_resumed(self, epoch: int) -> list:
        """The saved runs that consumed part of ``epoch`` (empty for a whole epoch)."""
        return list(self._resumed[1]) if self._resumed is not None and self._resumed[0] == int(epoch) else []
