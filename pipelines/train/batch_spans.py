"""The batch-level pointer: what every impression of a batch sees (its sample, its request, its span).

The loader's :class:`~userwise.pipelines.loader.JaggedBatch` stores the pointer
sample-relative (``req_seq_begin`` / ``req_seq_end`` per request, ``imp.req``
per impression). :func:`spans` turns it into batch-level index arrays: the
stored events of all samples form one flat sequence (``seq.offsets`` splits
it), and impression ``n`` sees the events ``[imp_begin[n], imp_end[n])`` of
that flat sequence. Everything here is torch on the batch's own device (host
or CUDA), without a Python loop over samples, requests or impressions.

Example::

    sp = spans(batch)
    sp.imp_begin[:3], sp.imp_end[:3]       # what the first three impressions see
    sp.event_sample                         # the sample of every stored event
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.jagged import request_spans, segment_ids

if TYPE_CHECKING:
    from userwise.pipelines.loader import JaggedBatch

__all__ = ["Spans", "spans"]


@dataclass(frozen=True)
class Spans:
    """Batch-level pointer arrays (all int64, on the batch's device).

    per sample (B): ``seq_offsets`` [B+1] into the flat stored events, ``req_offsets``
    [B+1], ``imp_offsets`` [B+1];
    per event (T): ``event_sample``;
    per request (R): ``req_sample``, ``req_begin`` / ``req_end`` (flat indices: the request
    sees events ``[req_begin, req_end)``);
    per impression (N): ``imp_sample``, ``imp_req`` (batch-level request), ``imp_begin`` /
    ``imp_end`` (its request's span, flat indices).

    Example::

        sp = Spans.from_arrays(seq_offsets=torch.tensor([0, 3]), req_offsets=torch.tensor([0, 2]),
                               req_begin=torch.tensor([0, 1]), req_end=torch.tensor([1, 3]),
                               imp_offsets=torch.tensor([0, 3]), imp_req=torch.tensor([0, 1, 1]))
        sp.imp_begin, sp.imp_end           # tensor([0, 1, 1]), tensor([1, 3, 3])
    """

    seq_offsets: torch.Tensor
    req_offsets: torch.Tensor
    imp_offsets: torch.Tensor
    event_sample: torch.Tensor
    req_sample: torch.Tensor
    req_begin: torch.Tensor
    req_end: torch.Tensor
    imp_sample: torch.Tensor
    imp_req: torch.Tensor
    imp_begin: torch.Tensor
    imp_end: torch.Tensor

    @property
    def num_samples(self) -> int:
        return self.seq_offsets.numel() - 1

    @property
    def num_events(self) -> int:
        return self.event_sample.numel()

    @property
    def num_requests(self) -> int:
        return self.req_sample.numel()

    @property
    def num_impressions(self) -> int:
        return self.imp_req.numel()

    @property
    def device(self) -> torch.device:
        return self.seq_offsets.device

    def requests_per_sample(self) -> torch.Tensor:
        return self.req_offsets[1:] - self.req_offsets[:-1]

    @classmethod
    def from_arrays(cls, *, seq_offsets, req_offsets, req_begin, req_end, imp_offsets, imp_req,
                    check: bool = True) -> "Spans":
        """Spans from the loader's arrays: ``seq_offsets``, ``req_offsets``, ``imp_offsets`` [B+1];
        ``req_begin`` / ``req_end`` sample-relative (as stored); ``imp_req`` batch-level."""
        so, ro, io = seq_offsets.long(), req_offsets.long(), imp_offsets.long()
        req_sample = segment_ids(ro)
        rb, re = req_begin.long(), req_end.long()
        if check and rb.numel():
            n_ev = (so[1:] - so[:-1])[req_sample]
            bad = (rb < 0) | (rb > re) | (re > n_ev)
            if bool(bad.any()):
                r = int(torch.nonzero(bad)[0, 0])
                raise UserwiseError(
                    f"request {r} of the batch points at events [{int(rb[r])}, {int(re[r])}) of a sample that stores "
                    f"{int(n_ev[r])}: the batch is not a user-wise batch (build it with the loader or shardgen)")
        g_begin, g_end = request_spans(so, req_sample, rb, re)
        ir = imp_req.long()
        imp_sample = req_sample[ir]
        if check and ir.numel() and bool((segment_ids(io) != imp_sample).any()):
            raise UserwiseError("imp.req points impressions at requests of other samples: the batch is not a "
                                "user-wise batch (build it with the loader or shardgen)")
        return cls(seq_offsets=so, req_offsets=ro, imp_offsets=io, event_sample=segment_ids(so),
                   req_sample=req_sample, req_begin=g_begin, req_end=g_end, imp_sample=imp_sample, imp_req=ir,
                   imp_begin=g_begin[ir], imp_end=g_end[ir])


def spans(batch: JaggedBatch, *, overrides: str = "refuse", check: bool = True) -> Spans:
    """The batch-level pointer of a :class:`JaggedBatch` (host or device).

    Fat-row batches: a request whose snapshot is null (``req_snapshot`` 2) sees nothing;
    one whose snapshot is an override (1: kept whole in ``ovr_*``, not a slice of the
    stored stream) has no span in the stored sequence. ``overrides="refuse"`` (default)
    raises for such a batch; ``"empty"`` gives those requests an empty span (their
    impressions are scored without history).
    ``check``: verify that every span lies inside its sample (one host sync).

    Example::

        sp = spans(batch)
        sp.imp_begin[:3], sp.imp_end[:3]       # what the first three impressions see
    """
    if overrides not in ("refuse", "empty"):
        raise ArgumentError(f"overrides={overrides!r}: use 'refuse' or 'empty'")
    begin, end = batch["req_seq_begin"].long(), batch["req_seq_end"].long()
    if "req_snapshot" in batch:
        kind = batch["req_snapshot"].long()
        n_ovr = int((kind == 1).sum())
        if n_ovr and overrides == "refuse":
            raise UserwiseError(
                f"the batch holds {n_ovr} fat-row requests whose snapshot is an override (not a slice of the stored "
                "sequence); pass overrides='empty' to score them without history")
        empty = kind != 0
        begin, end = torch.where(empty, 0, begin), torch.where(empty, 0, end)
    return Spans.from_arrays(seq_offsets=batch["seq.offsets"], req_offsets=batch["req.offsets"], req_begin=begin,
                             req_end=end, imp_offsets=batch["imp.offsets"], imp_req=batch["imp.req"], check=check)
