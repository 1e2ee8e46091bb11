"""Stochastic length (HSTU, arXiv 2402.17152, section 3.3): seeded sub-sampling of long
sequences at read time.

HSTU trains on a random subsequence of a long history: a sequence of ``n`` events,
with ``N`` the maximum length and ``alpha`` in (1, 2], is kept whole when
``n <= N ** (alpha / 2)``; otherwise, with probability ``1 - N ** alpha / n ** 2``, it is
cut to ``N ** (alpha / 2)`` events drawn uniformly (order kept), else kept whole. The
expected attention cost then grows as ``N ** alpha`` instead of ``N ** 2``.

Here the unit is the sample: its stored sequence is sub-sampled once, so a dropped
event is invisible to every request of the sample, and every request's span is
recomputed from the same choice: request ``r`` sees exactly the kept events of its old
span ``[seq_begin, seq_end)``, in order (a subset of what it saw, never anything new,
so never a later event). The stored sequence still holds exactly the kept events
from the smallest begin to the largest end.

The draw is a pure function of ``(seed, epoch, sample_id, event position)`` (a hash,
no generator state), so it does not depend on the batch a sample lands in, on the
device, or on the rank; a new epoch draws again.

Example::

    batch = stochastic_length(batch, max_len=1000, alpha=1.6, seed=0, epoch=loader.epoch)
"""

from __future__ import annotations

import torch

from userwise.pipelines.errors import ArgumentError
from userwise.pipelines.jagged import offsets, pack, positions, request_spans
from userwise.pipelines.loader import JaggedBatch

__all__ = ["stochastic_length", "keep_mask"]

M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _hash(seed: int, epoch: int, sample_id: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    h = _mix(torch.full_like(sample_id, (int(seed) * 0x9E3779B9 + int(epoch)) & M32))
    h = _mix(h ^ (sample_id & M32))
    h = _mix(h ^ ((sample_id >> 32) & M32))
    return _mix(h ^ (pos & M32))


def keep_mask(seq_offsets: torch.Tensor, sample_id: torch.Tensor, *, max_len: int, alpha: float, seed: int,
              epoch: int = 0) -> torch.Tensor:
    """Per stored event, True where stochastic length keeps it (see module doc)."""
    if not 1.0 < alpha <= 2.0:
        raise ArgumentError(f"alpha={alpha}: HSTU's stochastic length takes alpha in (1, 2]")
    if max_len < 1:
        raise ArgumentError(f"max_len={max_len}: use the sequences' maximum length (e.g. max_seq_len)")
    so = seq_offsets.long()
    n = so[1:] - so[:-1]
    keep_len = int(max_len ** (alpha / 2))
    sid = sample_id.long()
    ev_sample, pos = positions(so)
    # the per-sample draw: u < 1 - N^alpha / n^2 cuts the sample (only where n > N^(alpha/2))
    u = _hash(seed, epoch, sid, torch.full_like(sid, M32)).double() / 2.0 ** 32
    cut = (n > keep_len) & (u < 1.0 - (float(max_len) ** alpha) / n.double().clamp(min=1) ** 2)
    if not bool(cut.any()):
        return torch.ones(ev_sample.numel(), dtype=torch.bool, device=so.device)
    # keep the keep_len events with the smallest hash keys of each cut sample
    key = ev_sample * (1 << 32) + _hash(seed, epoch, sid[ev_sample], pos)
    order = torch.argsort(key, stable=True)  # ties (equal hashes) in position order, on any device
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=so.device) - so[:-1][ev_sample[order]]
    return ~cut[ev_sample] | (rank < keep_len)


def _with_arrays(batch: JaggedBatch, arrays: dict, meta: dict) -> JaggedBatch:
    """A new :class:`JaggedBatch` with some arrays replaced (same names and dtypes, any
    lengths), packed into one buffer on the batch's device as the loader packs it."""
    def fill(t):
        return lambda view: view.copy_(t.reshape(-1))

    items = []
    for name, *_ in batch.spec:
        t = arrays.get(name)
        t = batch[name] if t is None else t
        items.append((name, t.dtype, t.numel(), fill(t)))
    buf, spec = pack(items, lambda n: torch.empty(n, dtype=torch.uint8, device=batch.device))
    return JaggedBatch(buf, spec, meta)


def stochastic_length(batch: JaggedBatch, *, max_len: int, alpha: float = 1.6, seed: int = 0,
                      epoch: int = 0) -> JaggedBatch:
    """The batch with every sample's stored sequence sub-sampled (module doc); requests' spans,
    ``seq.offsets``, ``num_events`` and ``cost`` follow. Fat-row overrides are left as they are.

    Example::

        batch = stochastic_length(batch, max_len=1000, alpha=1.6, seed=0, epoch=loader.epoch)
    """
    if "sample_id" not in batch:
        raise ArgumentError("stochastic_length draws per sample_id; read the batch with the sample_id column")
    so = batch["seq.offsets"].long()
    keep = keep_mask(so, batch["sample_id"], max_len=max_len, alpha=alpha, seed=seed, epoch=epoch)
    if bool(keep.all()):
        return batch
    cols = batch.meta["columns"]
    strings = [n for n, (g, t) in cols.items() if g == "seq" and f"{n}.soff" in batch]
    if strings:
        raise ArgumentError(f"stochastic_length cannot sub-sample string sequence fields {strings}; "
                            "read the batch without them (columns=...)")
    csum = offsets(keep.long())  # kept events before each stored event
    new_so = csum[so]
    rs = batch["req.sample"].long()
    out = {"seq.offsets": new_so.to(batch["seq.offsets"].dtype)}
    for name, flat in zip(("req_seq_begin", "req_seq_end"),
                          request_spans(so, rs, batch["req_seq_begin"], batch["req_seq_end"])):
        out[name] = (csum[flat] - new_so[:-1][rs]).to(batch[name].dtype)
    for name, (group, _) in cols.items():
        if group == "seq":
            out[name] = batch[name][keep]
            if f"{name}.valid" in batch:
                out[f"{name}.valid"] = batch[f"{name}.valid"][keep]
    dropped = (so[1:] - so[:-1]) - (new_so[1:] - new_so[:-1])
    for name in ("num_events", "cost"):
        if name in batch:
            out[name] = (batch[name].long() - dropped).to(batch[name].dtype)
    meta = dict(batch.meta)
    if "events" in meta:
        meta["events"] = int(new_so[-1])
    return _with_arrays(batch, out, meta)
