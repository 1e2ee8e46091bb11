"""The kernels' argument layouts: a batch laid out for the HSTU attention kernels users run,
and what each kernel's mask is.

(Not the column layout of :mod:`userwise.schemas.layout` nor the loader's buffer layout,
:mod:`userwise.pipelines.loader.assembly.buffer_layout`.)

The kernels attend over jagged sequences of *slots*: a history (stored events) followed
by targets (impressions). Each layout records which stored event or impression sits in
every slot (``slot_event`` / ``slot_target``), so :meth:`KernelLayout.values` builds the
kernel's jagged input from per-event and per-impression tensors and
:meth:`KernelLayout.targets` reads the impressions' rows back out.

===========================  ==========================================  ==========================
kernel                       layout                                      exact for
===========================  ==========================================  ==========================
GR ``hstu_mha``              ``seq_offsets`` int64 [S+1], ``num_targets``  one request per sequence:
(generative-recommenders)    [S]; targets after the history               samples of one request as
                                                                          they are; otherwise split
                                                                          by request (or refused)
NVIDIA                       ``func`` (per-row intervals, ``n_func``       any sample: one sequence
``hstu_attn_varlen_func``    int32 [1, n_func, total + 256]), ``cu_seqlens`` per sample, each target
``mode="func"``              int32 [S+1]                                  sees its request's span
NVIDIA ``mode="targets"``    ``cu_seqlens`` int32, ``num_targets`` int32,   one request per sequence
                             ``target_group_size=1``, causal window         (split as for GR)
TorchRec KJT                 ``JaggedBatch.to_kjt(per="request")``         bags per request span
===========================  ==========================================  ==========================

Why ``num_targets`` alone is not enough: both kernels let every target see the whole
history of its sequence (GR's mask ``_get_valid_attn_mask`` and NVIDIA's target mask
only keep targets from seeing each other). A sample with several requests laid out as
one sequence would let a target of an early request see the events of later requests.
So with several requests per sample these layouts put each request in a sequence of its
own (its span, then its impressions: ``split="request"``; the history is then encoded per
request, as point-wise rows truncated at L are) or refuse (``split="refuse"``); they never
build the leaking layout. NVIDIA's ``func`` expresses the span per target row, so one
sequence per sample is exact there, and its history rows follow the chosen encoder
(``"sample"``: causal over the sample; ``"window"``: the ``window`` newest events).

:func:`hstu_mha_mask` and :func:`hstu_varlen_mask` rebuild, in plain torch, the slot mask
each kernel applies to a layout (from the kernels' documented semantics);
:func:`audit` maps it back to events and impressions and says whether it is leak-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.jagged import offsets, positions
from userwise.pipelines.train.batch_spans import Spans

__all__ = ["KernelLayout", "hstu_mha_layout", "hstu_varlen_layout", "hstu_mha_mask", "hstu_varlen_mask", "audit",
           "FUNC_PAD"]

FUNC_PAD = 256  # NVIDIA's kernel reads func rows past the last query row (its test pads by 256)


@dataclass(frozen=True)
class KernelLayout:
    """One kernel's jagged layout of a batch (see module doc): its ``offsets``, which event or
    impression each slot holds (``slot_event``, ``slot_target``, -1 where none), and the
    call's other arguments (:meth:`kwargs`).

    Example::

        lay = hstu_varlen_layout(sp)
        out = hstu_attn_varlen_func(q, k, v, **lay.kwargs())   # q = lay.values(ev_q, tgt_q)
        scores = lay.targets(out)                             # the impressions' rows, batch order
    """

    kernel: str
    offsets: torch.Tensor
    max_seq_len: int
    num_targets: torch.Tensor | None
    slot_event: torch.Tensor
    slot_target: torch.Tensor
    split: bool
    note: str
    func: torch.Tensor | None = None
    target_group_size: int | None = None
    window_size: tuple[int, int] | None = None

    @property
    def total(self) -> int:
        return self.slot_event.numel()

    def values(self, events: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The kernel's jagged input [total, ...]: ``events[slot_event]`` in history slots,
        ``targets[slot_target]`` in target slots."""
        both = torch.cat([events, targets], 0)
        t = events.shape[0]
        idx = torch.where(self.slot_event >= 0, self.slot_event, t + self.slot_target)
        return both[idx]

    def target_slots(self) -> torch.Tensor:
        """The slot of every impression, in batch order [N]."""
        is_t = self.slot_target >= 0
        pos = torch.nonzero(is_t).squeeze(1)
        out = torch.empty_like(pos)
        out[self.slot_target[pos]] = pos
        return out

    def targets(self, out: torch.Tensor) -> torch.Tensor:
        """The kernel output's rows of the impressions, in batch order."""
        return out[self.target_slots()]

    def kwargs(self) -> dict:
        """Keyword arguments of the kernel call (besides q, k, v)."""
        if self.kernel == "hstu_mha":
            return {"max_seq_len": self.max_seq_len, "seq_offsets": self.offsets, "causal": True,
                    "num_targets": self.num_targets}
        return {"seq_offsets_q": self.offsets, "seq_offsets_k": self.offsets, "max_seqlen_q": self.max_seq_len,
                "max_seqlen_k": self.max_seq_len, "num_contexts": None, "num_targets": self.num_targets,
                "target_group_size": self.target_group_size or 1, "window_size": self.window_size, "func": self.func}


def _per_sample(sp: Spans):
    """Slots of one sequence per sample: its stored events, then its impressions."""
    T = sp.seq_offsets[1:] - sp.seq_offsets[:-1]
    K = sp.imp_offsets[1:] - sp.imp_offsets[:-1]
    off = offsets(T + K)
    seq, p = positions(off)
    hist = p < T[seq]
    ev = torch.where(hist, sp.seq_offsets[:-1][seq] + p, -1)
    tg = torch.where(hist, -1, sp.imp_offsets[:-1][seq] + p - T[seq])
    return off, K, ev, tg, seq, p


def _per_request(sp: Spans):
    """Slots of one sequence per request: its span, then its impressions."""
    R = sp.num_requests
    H = sp.req_end - sp.req_begin
    K = torch.bincount(sp.imp_req, minlength=R)
    order = torch.argsort(sp.imp_req, stable=True)  # impressions grouped by request
    kstart = torch.cumsum(K, 0) - K
    off = offsets(H + K)
    seq, p = positions(off)
    hist = p < H[seq]
    ev = torch.where(hist, sp.req_begin[seq] + p, -1)
    j = torch.where(hist, 0, kstart[seq] + p - H[seq])
    tg = torch.where(hist, -1, order[j] if order.numel() else j)
    return off, K, ev, tg, seq, p


def _one_request_per_sample(sp: Spans) -> bool:
    """Every sample holds one request, and its span is the whole stored sequence."""
    if sp.num_samples == 0:
        return True
    if not bool((sp.requests_per_sample() <= 1).all()):
        return False
    first = sp.seq_offsets[:-1][sp.req_sample]
    last = sp.seq_offsets[1:][sp.req_sample]
    return bool(((sp.req_begin == first) & (sp.req_end == last)).all())


def _split_or_refuse(sp: Spans, split: str, kernel: str):
    if split not in ("auto", "request", "refuse"):
        raise ArgumentError(f"split={split!r}: use 'auto' (split only samples that need it: all of the batch), "
                            "'request' or 'refuse'")
    if split != "request" and _one_request_per_sample(sp):
        return False
    if split == "refuse":
        n = int((sp.requests_per_sample() > 1).sum())
        raise UserwiseError(
            f"{kernel} with num_targets lets every target see its whole sequence, and {n} samples of this batch "
            "hold several requests: an early request's targets would see later events. Pass split='request' "
            "(one sequence per request) or use hstu_varlen_layout(mode='func')")
    return True


def hstu_mha_layout(sp: Spans, *, split: str = "auto") -> KernelLayout:
    """generative-recommenders ``hstu_mha``: ``seq_offsets`` int64, ``num_targets`` int64.
    Samples of one request are laid out as they are; a batch with any sample of several
    requests is split into one sequence per request (``split="auto"``/``"request"``) or
    refused (``"refuse"``).

    Example::

        lay = hstu_mha_layout(spans(batch))
        audit(lay, spans(batch))["leak_free"]        # True
    """
    by_req = _split_or_refuse(sp, split, "hstu_mha")
    off, K, ev, tg, _, _ = (_per_request if by_req else _per_sample)(sp)
    n = off[1:] - off[:-1]
    note = ("one sequence per request (its span, then its impressions): exact; the history is encoded per request"
            if by_req else "one request per sample: the whole stored sequence is the span: exact")
    return KernelLayout("hstu_mha", off, int(n.max()) if n.numel() else 0, K.long(), ev, tg, by_req, note)


def hstu_varlen_layout(sp: Spans, *, mode: str = "func", encoder: str = "sample", window: int | None = None,
                       n_func: int = 3, self_attend: bool = False, split: str = "auto") -> KernelLayout:
    """NVIDIA recsys-examples ``hstu_attn_varlen_func``.

    ``mode="func"``: one sequence per sample (stored events, then impressions) and a per-row
    interval mask ``func`` int32 [1, n_func, total + 256] (``n_func`` odd, as the kernel was
    built: ``HSTU_ARBITRARY_NFUNC``, 3 by default): a row sees ``[0, f0) | [f1, f2) | ...``.
    History rows follow ``encoder`` (``"sample"``: ``[0, p + 1)``; ``"window"``: the ``window``
    newest up to itself); target rows see their request's span, and themselves with
    ``self_attend`` (needs ``n_func >= 5``). Exact for any sample.
    ``mode="targets"``: ``num_targets`` int32 with ``target_group_size=1`` and a causal window;
    laid out as :func:`hstu_mha_layout` (``split``).

    Example::

        lay = hstu_varlen_layout(spans(batch), mode="func", encoder="window", window=50)
        lay.kwargs()["func"].shape                   # [1, 3, total + 256]
    """
    if mode == "targets":
        by_req = _split_or_refuse(sp, split, "hstu_attn_varlen_func(num_targets)")
        off, K, ev, tg, _, _ = (_per_request if by_req else _per_sample)(sp)
        n = off[1:] - off[:-1]
        note = ("one sequence per request, target_group_size=1: exact" if by_req
                else "one request per sample, target_group_size=1: exact")
        return KernelLayout("hstu_attn_varlen_func", off.int(), int(n.max()) if n.numel() else 0, K.int(), ev, tg,
                            by_req, note, target_group_size=1, window_size=(-1, 0))
    if mode != "func":
        raise ArgumentError(f"mode={mode!r}: use 'func' (per-row intervals) or 'targets' (num_targets)")
    if n_func < 3 or n_func % 2 == 0:
        raise ArgumentError(f"n_func={n_func}: the kernel takes an odd count >= 3 (HSTU_ARBITRARY_NFUNC)")
    if self_attend and n_func < 5:
        raise ArgumentError("self_attend=True needs n_func >= 5 (span and self are two intervals after [0, f0))")
    if encoder not in ("sample", "window"):
        raise ArgumentError(f"encoder={encoder!r}: the func layout encodes the sample ('sample' or 'window')")
    if encoder == "window" and (window is None or window < 1):
        raise ArgumentError("encoder='window' needs window=W (events, >= 1)")
    off, K, ev, tg, seq, p = _per_sample(sp)
    total = seq.numel()
    hist = ev >= 0
    zero = torch.zeros_like(p)
    if sp.num_impressions:
        t = torch.where(hist, 0, tg)
        base = sp.seq_offsets[:-1][seq]
        b, e = sp.imp_begin[t] - base, sp.imp_end[t] - base
    else:
        b = e = zero
    func = torch.zeros(n_func, total + FUNC_PAD, dtype=torch.long, device=sp.device)
    if encoder == "sample":  # history row p: [0, p + 1)
        func[0, :total] = torch.where(hist, p + 1, zero)
        win_lo = win_hi = zero
    else:                    # history row p: [0, 0) | [p - window + 1, p + 1)
        win_lo, win_hi = (p - int(window) + 1).clamp(min=0), p + 1
    func[1, :total] = torch.where(hist, win_lo, b)  # target row: [0, 0) | [begin, end)
    func[2, :total] = torch.where(hist, win_hi, e)
    if self_attend:  # target row: ... | [p, p + 1)
        func[3, :total] = torch.where(hist, zero, p)
        func[4, :total] = torch.where(hist, zero, p + 1)
    n = off[1:] - off[:-1]
    return KernelLayout("hstu_attn_varlen_func", off.int(), int(n.max()) if n.numel() else 0, None, ev, tg, False,
                        "one sequence per sample, per-row intervals (func): exact for any sample",
                        func=func.int()[None], window_size=(-1, -1))


# -- what the kernels apply ------------------------------------------------------------
def _slots(slot_offsets: torch.Tensor):
    off = slot_offsets.long()
    seq, p = positions(off)
    return off, seq, p


def hstu_mha_mask(seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, max_attn_len: int = 0) -> torch.Tensor:
    """[total, total] bool: slot i attends to slot j under GR ``hstu_mha`` (causal, no
    contextual tokens). Targets share the id ``n - num_targets`` of the first target slot:
    a slot sees itself and the slots of smaller id, so every target sees the whole history
    and no other target; ``max_attn_len`` keeps ids at most that far back.

    Example::

        lay = hstu_mha_layout(sp)
        m = hstu_mha_mask(lay.offsets, lay.num_targets)   # [total, total]
    """
    off, seq, p = _slots(seq_offsets)
    n = (off[1:] - off[:-1])[seq]
    h = n - (num_targets.long()[seq] if num_targets is not None else 0)
    ids = torch.minimum(p, h)
    same = seq[:, None] == seq[None, :]
    dist = ids[:, None] - ids[None, :]
    eye = torch.eye(seq.numel(), dtype=torch.bool, device=off.device)
    m = same & (eye | (dist > 0))
    if max_attn_len > 0:
        m = m & (dist <= max_attn_len)
    return m


def hstu_varlen_mask(cu_seqlens: torch.Tensor, *, num_targets: torch.Tensor | None = None, target_group_size: int = 1,
                     window_size: tuple[int, int] = (-1, -1), func: torch.Tensor | None = None) -> torch.Tensor:
    """[total, total] bool: slot i attends to slot j under NVIDIA ``hstu_attn_varlen_func``
    (self-attention: the same offsets for q and k, no contexts). ``func``: row p sees
    ``[0, f0) | [f1, f2) | ...``; otherwise causal (``window_size=(-1, 0)``), where a target row
    does not see the targets before its own group of ``target_group_size``; ``num_targets``
    [B]: each sequence's targets (its last slots), ``window_size``: (left, right) slots a row sees.

    Example::

        lay = hstu_varlen_layout(sp)
        m = hstu_varlen_mask(lay.offsets, func=lay.func)   # [total, total]
    """
    off, seq, p = _slots(cu_seqlens)
    total = seq.numel()
    same = seq[:, None] == seq[None, :]
    c = p[None, :]
    if func is not None:
        f = func[0].long()[:, :total]  # [n_func, total]
        m = c < f[0][:, None]
        for j in range(1, f.shape[0] - 1, 2):  # the kernel's few intervals (n_func is 3 or 5), not data
            m = m | ((c >= f[j][:, None]) & (c < f[j + 1][:, None]))
        return same & m
    if tuple(window_size) != (-1, 0):
        raise ArgumentError("hstu_varlen_mask rebuilds the func and the causal (window_size=(-1, 0)) masks only")
    r = p[:, None]
    m = same & (c <= r)
    if num_targets is not None:
        n = (off[1:] - off[:-1])[seq]
        h = (n - num_targets.long()[seq])[:, None]
        g = int(target_group_size)
        left = h + ((r - h) // g) * g
        m = m & ~((r >= h) & (c >= h) & (c < left))
    return m


def _closure(m: torch.Tensor) -> torch.Tensor:
    """Reachability through any number of layers (repeated squaring)."""
    r = m.clone()
    while True:
        nxt = r | ((r.float() @ r.float()) > 0)
        if torch.equal(nxt, r):
            return r
        r = nxt


def audit(layout: KernelLayout, sp: Spans, mask: torch.Tensor | None = None) -> dict:
    """Map a kernel's slot mask (default: the one the layout's kernel applies) back to the
    batch and check it. Returns booleans:

    - ``spans_exact``: every target's slot sees exactly the events of its request's span;
    - ``no_later_events``: through any number of layers, a target depends on no stored event
      at or after its request time (index >= its ``seq_end``);
    - ``no_other_impressions``: through any number of layers, a target depends on no other
      impression;

    and ``leak_free`` (the last two).

    Example::

        sp = spans(batch)
        audit(hstu_varlen_layout(sp), sp)   # {"spans_exact": True, ..., "leak_free": True}
    """
    if mask is None:
        if layout.kernel == "hstu_mha":
            mask = hstu_mha_mask(layout.offsets, layout.num_targets)
        else:
            mask = hstu_varlen_mask(layout.offsets, num_targets=layout.num_targets,
                                    target_group_size=layout.target_group_size or 1,
                                    window_size=layout.window_size or (-1, -1), func=layout.func)
    T, N = sp.num_events, sp.num_impressions
    ev, tg = layout.slot_event, layout.slot_target
    E = torch.zeros(layout.total, T, dtype=torch.bool, device=mask.device)
    h = torch.nonzero(ev >= 0).squeeze(1)
    E[h, ev[h]] = True
    G = torch.zeros(layout.total, N, dtype=torch.bool, device=mask.device)
    t = torch.nonzero(tg >= 0).squeeze(1)
    G[t, tg[t]] = True
    ts = layout.target_slots()
    direct = (mask[ts].float() @ E.float()) > 0  # [N, T]
    reach = _closure(mask)[ts]
    reach_ev = (reach.float() @ E.float()) > 0
    reach_tg = (reach.float() @ G.float()) > 0
    k = torch.arange(T, device=mask.device)
    want = (k[None, :] >= sp.imp_begin[:, None]) & (k[None, :] < sp.imp_end[:, None])
    later = k[None, :] >= sp.imp_end[:, None]
    other = ~torch.eye(N, dtype=torch.bool, device=mask.device)
    out = {"spans_exact": bool(torch.equal(direct, want)),
           "no_later_events": not bool((reach_ev & later).any()),
           "no_other_impressions": not bool((reach_tg & other).any())}
    out["leak_free"] = out["no_later_events"] and out["no_other_impressions"]
    return out
