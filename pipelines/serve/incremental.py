"""Serving a :class:`~userwise.pipelines.train.ReferenceRanker` from a per-user K/V cache.

With a causal encoder an event's encoding depends on itself and older events only, so
a user's history is encoded once (:func:`prefill`), new behaviour is appended as
incremental K/V (:func:`extend`), and a request computes only its candidates' target
attention over the cached history (:func:`score`). The result equals the training
forward over the whole held sequence (:func:`full_scores`, the full recompute): the
request's visible span is the newest ``max_seq_len`` held events, as training's
``seq_begin = max(0, n - L)`` gives it (tested to 1e-9 in float64, 1e-5 in float32; in
float16 and bfloat16, the model's dtype when it serves in half precision, to two units of the
dtype's precision at the logits' scale, ``2 * eps * max|logits|``: the two paths round in
different orders, and agree to about one unit).

Which encoders are cacheable (``ReferenceRanker(encoder=...)``):

- ``"sample"``: each event attends to every earlier held event; the state keeps every
  layer's K/V;
- ``"window"`` (``window=W``): each event attends to the ``W`` newest events up to
  itself, per layer; an extend reads the last ``W - 1`` held K/V of each layer;
- ``"none"``: the state holds the target attention's keys and values of the event
  embeddings;
- ``"request"`` is refused: it re-encodes each request's span on its own, so an event's
  encoding changes as the span moves (not prefix-stable).

:func:`check_prefix_stable` tests an encoder for this property: it encodes a sequence,
encodes it again with events appended, and reports any earlier position whose output
changed (an encoder with reverse positions or times relative to the newest event fails).

The state (:class:`KVState`) is paged: pages of ``page_size`` (P) events, each page one
tensor ``[2 * layers + 2, rows, dim]``: slots ``2l`` and ``2l + 1`` hold the keys and
values of encoder layer ``l`` (``qkv(norm1(x))``'s K and V, heads flattened), the last
two slots the target attention's keys and values of the encoded events (``tk(enc)``,
``tv(enc)``). Every page but the last holds P rows. States are immutable: an extend
shares the full pages and writes new ones; :func:`score` never changes a state
(candidates are never cached). Pages are in the model's dtype (float32, float64, float16 or
bfloat16: ``model.to(torch.bfloat16)`` serves bfloat16 pages); a state of another dtype than
the model's is refused, never mixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.train.attention import attend
from userwise.pipelines.train.batch_spans import Spans
from userwise.pipelines.train.inputs import UserBatch
from userwise.pipelines.train.masks import Intervals
from userwise.pipelines.train.model import ReferenceRanker

__all__ = ["Events", "Candidates", "KVState", "prefill", "extend", "score", "full_scores", "empty_state",
           "PrefixCheck", "check_prefix_stable", "training_encoder", "CACHEABLE"]

CACHEABLE = ("sample", "window", "none")


def _long(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ArgumentError(f"{name} must hold integer ids, got {t.dtype}")
    return t.long()


@dataclass(frozen=True)
class Events:
    """A user's events in order: ``item`` [n], ``side`` [n, F] (side-info features), ``action``
    [n] (action bits), int64; ``time`` [n] optional (ReferenceRanker does not read it; an
    encoder that buckets time does).

    Example::

        ev = Events(item=torch.tensor([5, 9]), side=torch.tensor([[1, 2], [3, 4]]), action=torch.tensor([1, 2]))
        ev[1:], ev.cat(ev), len(ev)
    """

    item: torch.Tensor
    side: torch.Tensor
    action: torch.Tensor
    time: torch.Tensor | None = None

    def __post_init__(self):
        for name in ("item", "side", "action") + (("time",) if self.time is not None else ()):
            object.__setattr__(self, name, _long(getattr(self, name), f"Events.{name}"))
        n = self.item.shape[0]
        if self.item.dim() != 1 or self.side.dim() != 2 or self.side.shape[0] != n or self.action.shape != (n,) or \
                (self.time is not None and self.time.shape != (n,)):
            raise ArgumentError(f"Events: item {tuple(self.item.shape)}, side {tuple(self.side.shape)}, action "
                                f"{tuple(self.action.shape)}: use item [n], side [n, F], action [n] (time [n])")

    def __len__(self) -> int:
        return self.item.shape[0]

    def __getitem__(self, s: slice) -> "Events":
        if not isinstance(s, slice):
            raise ArgumentError("Events are sliced with a range (events[a:b]), not indexed")
        return Events(self.item[s], self.side[s], self.action[s], None if self.time is None else self.time[s])

    def cat(self, other: "Events") -> "Events":
        """These events followed by ``other``'s."""
        times = [e.time for e in (self, other) if e.time is not None]
        if len(times) == 1 and len(self if self.time is None else other):
            raise ArgumentError("Events.cat: both parts need time, or neither")
        t = torch.cat(times) if times else None
        return Events(torch.cat([self.item, other.item]), torch.cat([self.side, other.side]),
                      torch.cat([self.action, other.action]), t)

    def to(self, device) -> "Events":
        return Events(self.item.to(device), self.side.to(device), self.action.to(device),
                      None if self.time is None else self.time.to(device))

    def fields(self) -> np.ndarray:
        """int64 [n, F + 2]: each event's fields in the order the chain hashes them (item, the
        side-info features, action; not time)."""
        return torch.cat([self.item[:, None], self.side, self.action[:, None]], 1).cpu().numpy()

    @classmethod
    def empty(cls, side_features: int, device=None) -> "Events":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, torch.zeros(0, side_features, dtype=torch.long, device=device), z)


@dataclass(frozen=True)
class Candidates:
    """A request's candidates: ``item`` [c] and ``side`` [c, F], int64 (scored, never cached).

    Example::

        cands = Candidates(item=torch.tensor([3, 4]), side=torch.tensor([[1, 2], [5, 6]]))
    """

    item: torch.Tensor
    side: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "item", _long(self.item, "Candidates.item"))
        object.__setattr__(self, "side", _long(self.side, "Candidates.side"))
        if self.item.dim() != 1 or self.side.dim() != 2 or self.side.shape[0] != self.item.shape[0]:
            raise ArgumentError(f"Candidates: item {tuple(self.item.shape)}, side {tuple(self.side.shape)}: "
                                "use item [c], side [c, F]")

    def __len__(self) -> int:
        return self.item.shape[0]


@dataclass(frozen=True)
class KVState:
    """A user's cached encoder state (see module doc): ``pages`` (each ``[slots, rows, dim]``,
    every one but the last ``page_size`` rows), ``length`` (events held), ``page_size`` (P),
    ``max_seq_len`` (L: a request sees the newest L held events).

    Example::

        st = prefill(model, history, max_seq_len=50, page_size=64)
        st.length, len(st.pages), st.nbytes
    """

    pages: tuple
    length: int
    page_size: int
    max_seq_len: int

    def __post_init__(self):
        object.__setattr__(self, "pages", tuple(self.pages))
        if self.page_size < 1 or self.max_seq_len < 1:
            raise ArgumentError(f"page_size={self.page_size}, max_seq_len={self.max_seq_len}: use numbers >= 1")
        rows = [int(p.shape[1]) for p in self.pages]
        if sum(rows) != self.length or any(r != self.page_size for r in rows[:-1]) or \
                (rows and not 0 < rows[-1] <= self.page_size):
            raise ArgumentError(f"a KVState of {self.length} events has pages of {rows} rows: every page but the "
                                f"last holds page_size={self.page_size} rows, the last 1 to page_size")

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pages)

    @property
    def slots(self) -> int | None:
        return int(self.pages[0].shape[0]) if self.pages else None

    def rows(self, start: int, stop: int, slots: slice = slice(None)) -> torch.Tensor | None:
        """Rows ``[start, stop)`` of the held events, ``[slots, stop - start, dim]`` (None when no
        page is held)."""
        if not self.pages:
            return None
        P = self.page_size
        parts = [self.pages[i][slots, max(start - i * P, 0):min(stop - i * P, P)]
                 for i in range(start // P, -(-stop // P))]
        if not parts:
            return self.pages[0][slots, :0]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def truncate(self, n: int) -> "KVState":
        """The state of the first ``n`` events (``n`` a multiple of ``page_size`` or the length)."""
        if n == self.length:
            return self
        if n % self.page_size or not 0 <= n <= self.length:
            raise ArgumentError(f"truncate({n}): a state of {self.length} events truncates at a page boundary "
                                f"(a multiple of {self.page_size}) or its length")
        return KVState(self.pages[:n // self.page_size], n, self.page_size, self.max_seq_len)

    def clone(self) -> "KVState":
        """A copy that owns its pages (a state read from a store is valid while its lease is held)."""
        return KVState(tuple(p.clone() for p in self.pages), self.length, self.page_size, self.max_seq_len)


def _check(model: ReferenceRanker, state: KVState | None = None):
    if not isinstance(model, ReferenceRanker):
        raise ArgumentError(f"incremental serving takes a ReferenceRanker, got {type(model).__name__}")
    if model.encoder == "request":
        raise ArgumentError("encoder='request' re-encodes each request's span on its own, so an event's encoding "
                            "changes as the span moves: it is not prefix-stable and its K/V cannot be cached; "
                            "serve it with full_scores, or train with encoder='sample' or 'window'")
    if state is not None and state.pages:
        want = (2 * len(model.blocks) + 2, model.dim)
        got = (int(state.pages[0].shape[0]), int(state.pages[0].shape[2]))
        if got != want:
            raise ArgumentError(f"the state's pages are [{got[0]} slots, dim {got[1]}], the model's [{want[0]}, "
                                f"{want[1]}]: the state was made by another model; prefill it again")
        have, dtype = state.pages[0].dtype, _param(model).dtype
        if have != dtype:
            raise ArgumentError(f"the state's pages are {have}, the model's weights {dtype}: a state is served by a "
                                f"model of its own dtype; prefill it again with this model, or model.to({have})")


def empty_state(model: ReferenceRanker, *, max_seq_len: int, page_size: int = 64) -> KVState:
    """The state of no events, for requests of ``max_seq_len`` events at most, in pages of
    ``page_size`` events (the cache's P).

    Example::

        st = extend(model, empty_state(model, max_seq_len=50), history)   # == prefill(model, history, ...)
    """
    _check(model)
    return KVState((), 0, int(page_size), int(max_seq_len))


def _kw(model) -> dict:
    return {} if model.attention == "dense" else {"block": model.block}  # dense_attention takes no block


def _param(model):
    return next(model.parameters())


@torch.no_grad()
def extend(model: ReferenceRanker, state: KVState, new: Events) -> KVState:
    """The state with ``new`` events appended: each new event's encoding attends, per layer,
    to the held K/V it may see (all of them for ``"sample"``, the last ``window - 1`` for
    ``"window"``) and to the new events up to itself. ``state`` is not changed.

    Example::

        st = extend(model, st, Events(item=..., side=..., action=...))
    """
    _check(model, state)
    m = len(new)
    if m == 0:
        return state
    p = _param(model)
    new = new.to(p.device)
    n0, P, d, H = state.length, state.page_size, model.dim, model.heads
    x = model.embed_events(new.item, new.side, new.action)
    keep = 0 if model.window is None else max(0, n0 - (model.window - 1))  # held keys an extend can see
    held = state.rows(keep, n0)
    i = torch.arange(n0, n0 + m, device=p.device)
    lo = torch.zeros_like(i) if model.window is None else (i - model.window + 1).clamp(min=0)
    iv = Intervals(lo - keep, i + 1 - keep, n0 - keep + m)
    out = []
    for li, blk in enumerate(model.blocks):
        q, k, v = blk.qkv(blk.norm1(x)).view(m, 3, H, d // H).unbind(1)
        k_all, v_all = k.reshape(m, d), v.reshape(m, d)
        if held is not None:
            k_all, v_all = torch.cat([held[2 * li], k_all]), torch.cat([held[2 * li + 1], v_all])
        a = attend(q, k_all.view(-1, H, d // H), v_all.view(-1, H, d // H), iv, model.attention, **_kw(model))
        x = x + blk.out(a.reshape(m, d))
        x = x + blk.mlp(blk.norm2(x))
        out += [k.reshape(m, d), v.reshape(m, d)]
    rows = torch.stack(out + [model.tk(x), model.tv(x)])  # [slots, m, dim]
    pages = list(state.pages)
    if pages and pages[-1].shape[1] < P:  # the partial last page is rewritten, never changed in place
        rows = torch.cat([pages.pop(), rows], 1)
    pages += [rows[:, a:a + P].clone() for a in range(0, rows.shape[1], P)]
    return KVState(tuple(pages), n0 + m, P, state.max_seq_len)


def prefill(model: ReferenceRanker, history: Events, *, max_seq_len: int, page_size: int = 64) -> KVState:
    """The state of a user's history (``max_seq_len``: the L the model was trained with).

    Example::

        st = prefill(model, history, max_seq_len=50, page_size=64)
        logits = score(model, st, candidates)
    """
    return extend(model, empty_state(model, max_seq_len=max_seq_len, page_size=page_size), history)


@torch.no_grad()
def score(model: ReferenceRanker, state: KVState, candidates: Candidates) -> torch.Tensor:
    """Logits ``[c, num_labels]``: each candidate's target attention over the newest
    ``max_seq_len`` held events' cached keys and values, and the head. The state is not
    changed and the candidates are not cached.

    Example::

        logits = score(model, st, Candidates(item=items, side=sides))
    """
    _check(model, state)
    p = _param(model)
    c, d, H = len(candidates), model.dim, model.heads
    n = state.length
    b = max(0, n - state.max_seq_len)
    kv = state.rows(b, n, slice(-2, None))
    t = model.embed_targets(candidates.item.to(p.device), candidates.side.to(p.device))
    q = model.tq(t).view(c, H, d // H)
    if kv is None:
        kv = t.new_zeros(2, 0, d)
    k, v = kv[0].reshape(-1, H, d // H), kv[1].reshape(-1, H, d // H)
    iv = Intervals(torch.zeros(c, dtype=torch.long, device=p.device),
                   torch.full((c,), n - b, dtype=torch.long, device=p.device), n - b)
    a = attend(q, k, v, iv, model.attention, **_kw(model)).reshape(c, d)
    return model.head(torch.cat([t, a], 1))


@torch.no_grad()
def full_scores(model: ReferenceRanker, events: Events, candidates: Candidates, max_seq_len: int) -> torch.Tensor:
    """The full recompute: the training forward (``model(UserBatch)``) over one sample that
    stores every held event, with one request whose span is ``[max(0, n - L), n)`` and the
    candidates as its impressions. Logits ``[c, num_labels]`` (any encoder, ``"request"`` too).

    Example::

        assert torch.allclose(score(model, st, cands), full_scores(model, history, cands, 50))
    """
    p = _param(model)
    events = events.to(p.device)
    n, c = len(events), len(candidates)
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=p.device)  # noqa: E731
    sp = Spans.from_arrays(seq_offsets=t([0, n]), req_offsets=t([0, 1]), req_begin=t([max(0, n - int(max_seq_len))]),
                           req_end=t([n]), imp_offsets=t([0, c]), imp_req=torch.zeros(c, dtype=torch.long,
                                                                                    device=p.device))
    labels = torch.zeros(c, model.head[-1].out_features, device=p.device)
    ub = UserBatch(ev_item=events.item, ev_side=events.side, ev_action=events.action,
                   tgt_item=candidates.item.to(p.device), tgt_side=candidates.side.to(p.device), labels=labels, spans=sp)
    return model(ub)


# -- cacheability --------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixCheck:
    """What :func:`check_prefix_stable` found: ``ok``, ``max_abs_diff`` over the earlier
    positions, ``first_changed`` (the first earlier position whose output changed, or None),
    ``checked`` (earlier positions compared). True when ``ok``.

    Example::

        r = check_prefix_stable(training_encoder(model), history, new)
        if not r: print(r.first_changed, r.max_abs_diff)
    """

    ok: bool
    max_abs_diff: float
    first_changed: int | None
    checked: int

    def __bool__(self) -> bool:
        return self.ok

    def raise_if_not(self) -> "PrefixCheck":
        if not self.ok:
            raise UserwiseError(f"the encoder is not prefix-stable: appending events changed the output at position "
                                f"{self.first_changed} by {self.max_abs_diff:.3g}; its K/V cannot be cached")
        return self


@torch.no_grad()
def check_prefix_stable(encode: Callable[[Events], torch.Tensor], events: Events, appended: Events, *,
                        atol: float = 0.0) -> PrefixCheck:
    """Encode ``events``, encode ``events + appended``, and compare the outputs at the
    earlier positions (``encode`` gives ``[n, ...]`` per sequence; NaN marks a position
    without an output). Changed by more than ``atol`` anywhere: not cacheable.

    Example::

        check_prefix_stable(training_encoder(model), history, new, atol=1e-9).raise_if_not()
    """
    n = len(events)
    a = encode(events)
    b = encode(events.cat(appended))[:n]
    if a.shape != b.shape:
        raise UserwiseError(f"the encoder gave {tuple(a.shape)} for {n} events and {tuple(b.shape)} for their first "
                            f"{n} after appending: it must give one output per event")
    if n == 0:
        return PrefixCheck(ok=True, max_abs_diff=0.0, first_changed=None, checked=0)
    a, b = a.reshape(n, -1).double(), b.reshape(n, -1).double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, 0.0, (a - b).abs().nan_to_num(nan=math.inf))
    per_pos = diff.amax(1) if diff.shape[1] else torch.zeros(n, dtype=torch.float64)
    bad = torch.nonzero(per_pos > atol)
    mx = float(per_pos.max())
    return PrefixCheck(ok=not len(bad), max_abs_diff=mx, first_changed=int(bad[0, 0]) if len(bad) else None, checked=n)


def training_encoder(model: ReferenceRanker, max_seq_len: int | None = None) -> Callable[[Events], torch.Tensor]:
    """The model's training encoder over one held sequence, as a function of its events:
    ``[n, dim]`` encoded events (``"request"``: the newest ``max_seq_len`` events encoded as
    one request's span, NaN before it).

    Example::

        check_prefix_stable(training_encoder(model), history, new)
    """
    if model.encoder == "request" and max_seq_len is None:
        raise ArgumentError("training_encoder of encoder='request' needs max_seq_len (the span it encodes)")

    @torch.no_grad()
    def encode(ev: Events) -> torch.Tensor:
        p = _param(model)
        ev = ev.to(p.device)
        x = model.embed_events(ev.item, ev.side, ev.action)
        n = len(ev)
        if model.encoder == "none":
            return x
        if model.encoder == "request":
            b = max(0, n - int(max_seq_len))
            out = torch.full_like(x, math.nan)
            out[b:] = model.encode(x[b:], torch.tensor([0, n - b], device=p.device), None)
            return out
        return model.encode(x, torch.tensor([0, n], device=p.device), model.window)

    return encode
