"""The model's inputs: a user-wise batch and the point-wise rows it expands into.

:class:`UserBatch` holds, for a :class:`JaggedBatch` (host or device), the stored
events' ids (item, side-info, action bits), every impression's target ids and
labels, and the batch's :class:`~userwise.pipelines.train.batch_spans.Spans`.

:class:`PointwiseBatch` is the point-wise form: one row per impression, each with
its own copy of a history. :meth:`PointwiseBatch.from_rows` reads the rows that
``expand_batch`` gives back (a pyarrow table); :meth:`UserBatch.expand` builds the
same rows in torch, and also the two references the causal encoder is defined
against (see docs/training.md, "The causal encoder"):

- ``history="span"``: the request's span ``stored[begin:end]``, what ``expand_batch``
  gives (point-wise rows truncated at L);
- ``history="prefix"``: everything the sample stores before the request,
  ``stored[0:end]``, with the target's span starting at ``begin`` within it;
- ``history="window"`` (with ``reach``): ``stored[max(0, begin - reach):end]``.

:class:`Fields` names the columns: from the batch's roles (lean builds, :meth:`Fields.from_roles`:
``seq_item`` / ``imp__<item>``, one pair per item feature, ``seq_action``, the labels), or
given explicitly (fat-row builds name their snapshot's fields freely). It has no defaults:
the synthetic log's names are no build's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.jagged import offsets, ranges
from userwise.pipelines.train.batch_spans import Spans, spans
from userwise.schemas.layout import field_name, input_name

__all__ = ["Fields", "UserBatch", "PointwiseBatch"]


@dataclass(frozen=True)
class Fields:
    """Column names of a batch. ``item``: (sequence field, impression column); ``side``: one such
    pair per side-info feature; ``action``: the sequence's action bits (or None); ``labels``:
    impression columns (0/1). Every field is given: from a batch's roles (:meth:`from_roles`) or
    explicitly.

    Example::

        f = Fields.from_roles(batch.meta["roles"])     # lean builds: from the build's roles
        f = Fields(item=("seq_item", "imp__item_id"), side=(("seq_category", "imp__category"),),
                   action="seq_action", labels=("imp__click",))
    """

    item: tuple[str, str]
    side: tuple[tuple[str, str], ...]
    action: str | None
    labels: tuple[str, ...]

    @classmethod
    def from_roles(cls, roles: dict) -> "Fields":
        """From a batch's ``meta["roles"]``: the item, one pair per item feature, the action
        bits, the labels (lean builds; fat-row builds name their snapshot roles freely: pass
        :class:`Fields` yourself)."""
        if not roles or roles.get("fat"):
            raise ArgumentError("the batch is from a fat-row build (or has no roles): its sequence fields are the "
                                "snapshot's roles; pass fields=Fields(item=(seq, imp), side=..., labels=...)")
        side = tuple((f"seq_{field_name(f)}", f"imp__{f}") for f in roles["item_features"])
        return cls(item=("seq_item", f"imp__{roles['item']}"), side=side, action="seq_action",
                   labels=tuple(f"imp__{c}" for c in roles["labels"]))

    def row_names(self) -> "Fields":
        """The same fields under the names ``expand_batch`` gives its columns."""
        imp = lambda c: input_name(c[len("imp__"):])  # noqa: E731
        return Fields(item=(self.item[0], imp(self.item[1])), side=tuple((s, imp(i)) for s, i in self.side),
                      action=self.action, labels=tuple(imp(c) for c in self.labels))


def _need(batch, name):
    if name not in batch:
        raise ArgumentError(f"the batch has no column {name!r}; pass fields=Fields(...) naming its columns")
    return batch[name]


@dataclass
class UserBatch:
    """One user-wise batch as model input (see module doc). ``ev_*`` per stored event (T),
    ``tgt_*`` and ``labels`` per impression (N); ``*_side`` is [., S] int64.

    Example::

        ub = UserBatch.from_jagged(batch)              # the columns named by the batch's roles
        logits = model(ub); loss = model.loss(logits, ub.labels)
        pb = ub.expand("span")                         # the same impressions as point-wise rows
    """

    ev_item: torch.Tensor
    ev_side: torch.Tensor
    ev_action: torch.Tensor
    tgt_item: torch.Tensor
    tgt_side: torch.Tensor
    labels: torch.Tensor
    spans: Spans

    @classmethod
    def from_jagged(cls, batch, fields: Fields | None = None, *, overrides: str = "refuse") -> "UserBatch":
        """The model's input of a :class:`~userwise.pipelines.loader.JaggedBatch` (host or
        device): its columns named by ``fields`` (default :meth:`Fields.from_roles` of the
        batch's roles), its spans by :func:`~userwise.pipelines.train.spans` (``overrides``)."""
        fields = fields or Fields.from_roles(batch.meta.get("roles") or {})
        sp = spans(batch, overrides=overrides)
        T, N = sp.num_events, sp.num_impressions
        dev = sp.device

        def side(group):
            cols = [_need(batch, pair[group]).long() for pair in fields.side]
            n = T if group == 0 else N
            return torch.stack(cols, 1) if cols else torch.zeros(n, 0, dtype=torch.long, device=dev)

        action = _need(batch, fields.action).long() if fields.action else torch.zeros(T, dtype=torch.long, device=dev)
        labels = torch.stack([_need(batch, c).float() for c in fields.labels], 1) if fields.labels else \
            torch.zeros(N, 0, device=dev)
        return cls(ev_item=_need(batch, fields.item[0]).long(), ev_side=side(0), ev_action=action,
                   tgt_item=_need(batch, fields.item[1]).long(), tgt_side=side(1), labels=labels, spans=sp)

    def to(self, device, non_blocking: bool = False) -> "UserBatch":
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        sp = Spans(**{k: mv(getattr(self.spans, k)) for k in self.spans.__dataclass_fields__})
        return UserBatch(mv(self.ev_item), mv(self.ev_side), mv(self.ev_action), mv(self.tgt_item),
                         mv(self.tgt_side), mv(self.labels), sp)

    @property
    def num_impressions(self) -> int:
        return self.spans.num_impressions

    def expand(self, history: str = "span", reach: int = 0) -> "PointwiseBatch":
        """The point-wise rows of this batch (one per impression, in batch order), each with a
        copy of its history: ``"span"`` (what ``expand_batch`` gives), ``"prefix"`` or
        ``"window"`` (see module doc; ``reach`` events before the span for ``"window"``)."""
        sp = self.spans
        sample_start = sp.seq_offsets[:-1][sp.imp_sample]
        if history == "span":
            start = sp.imp_begin
        elif history == "prefix":
            start = sample_start
        elif history == "window":
            start = torch.maximum(sample_start, sp.imp_begin - int(reach))
        else:
            raise ArgumentError(f"history={history!r}: use 'span', 'prefix' or 'window'")
        n = sp.imp_end - start
        idx = ranges(start, n)
        return PointwiseBatch(hist_item=self.ev_item[idx], hist_side=self.ev_side[idx], hist_action=self.ev_action[idx],
                              hist_offsets=offsets(n), visible_from=sp.imp_begin - start, tgt_item=self.tgt_item,
                              tgt_side=self.tgt_side, labels=self.labels)


@dataclass
class PointwiseBatch:
    """Point-wise rows: row ``n``'s history is ``hist_*[hist_offsets[n]:hist_offsets[n+1]]``; its
    target attends to the history from ``visible_from[n]`` on (0: all of it).

    Example::

        pb = PointwiseBatch.from_rows(expand_batch(batch), Fields.from_roles(batch.meta["roles"]))
        logits = model.forward_pointwise(pb)
    """

    hist_item: torch.Tensor
    hist_side: torch.Tensor
    hist_action: torch.Tensor
    hist_offsets: torch.Tensor
    visible_from: torch.Tensor
    tgt_item: torch.Tensor
    tgt_side: torch.Tensor
    labels: torch.Tensor

    @property
    def num_impressions(self) -> int:
        return self.tgt_item.numel()

    @classmethod
    def from_rows(cls, table, fields: Fields) -> "PointwiseBatch":
        """From the rows ``expand_batch`` (or ``userwise expand``) gives: a pyarrow table with the
        impression columns under their input names and each row's history as list columns.
        ``fields`` is the batch's :class:`Fields` (the names are mapped as ``expand`` maps them)."""
        f = fields.row_names()
        missing = [c for c in [f.item[0], f.item[1], *[x for p in f.side for x in p], *f.labels,
                               *([f.action] if f.action else [])] if c not in table.column_names]
        if missing:
            raise ArgumentError(f"the rows have no column(s) {missing}; they have {table.column_names}")

        def lst(name):
            arr = table.column(name).combine_chunks()
            if arr.null_count:
                raise UserwiseError(f"column {name!r} holds null histories (fat-row null snapshots): fill them first")
            off = np.asarray(arr.offsets, dtype=np.int64)
            vals = np.asarray(arr.values.slice(int(off[0]), int(off[-1] - off[0])), dtype=np.int64)
            return torch.from_numpy(vals.copy()), torch.from_numpy(off - off[0])

        def col(name, dtype=np.int64):
            return torch.from_numpy(np.asarray(table.column(name).combine_chunks().fill_null(0), dtype=dtype).copy())

        item, off = lst(f.item[0])
        n = len(off) - 1
        hs = [lst(s)[0] for s, _ in f.side]
        action = lst(f.action)[0] if f.action else torch.zeros_like(item)
        labels = torch.stack([col(c, np.float32) for c in f.labels], 1) if f.labels else torch.zeros(n, 0)
        return cls(hist_item=item, hist_side=torch.stack(hs, 1) if hs else torch.zeros(len(item), 0, dtype=torch.long),
                   hist_action=action, hist_offsets=off, visible_from=torch.zeros(n, dtype=torch.long),
                   tgt_item=col(f.item[1]), tgt_side=torch.stack([col(i) for _, i in f.side], 1) if f.side else
                   torch.zeros(n, 0, dtype=torch.long), labels=labels)

    def slice(self, start: int, stop: int) -> "PointwiseBatch":
        """Rows ``[start, stop)`` (micro-batches of a large point-wise step)."""
        a, b = int(self.hist_offsets[start]), int(self.hist_offsets[stop])
        return PointwiseBatch(self.hist_item[a:b], self.hist_side[a:b], self.hist_action[a:b],
                              self.hist_offsets[start:stop + 1] - a, self.visible_from[start:stop],
                              self.tgt_item[start:stop], self.tgt_side[start:stop], self.labels[start:stop])

    def to(self, device, non_blocking: bool = False) -> "PointwiseBatch":
        return PointwiseBatch(*[getattr(self, k).to(device, non_blocking=non_blocking)
                                for k in self.__dataclass_fields__])
