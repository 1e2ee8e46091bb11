"""Incremental serving equals the training forward: prefill, extends of any size (0, not a
multiple of the page size) and scoring give the logits of ``model(UserBatch)`` over the whole
held sequence (1e-9 in float64, 1e-5 in float32, absolute, rtol 0); scoring never changes a
state; the prefix-stability check passes the cacheable encoders and fails an encoder built
like generative-recommenders' (positions and times relative to the newest event)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve import (
    Candidates,
    Events,
    check_prefix_stable,
    empty_state,
    extend,
    full_scores,
    prefill,
    score,
    training_encoder,
)
from userwise.pipelines.train import ReferenceRanker

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def _model(encoder, *, layers=2, window=None, dtype=torch.float64, seed=0, attention="blocks"):
    torch.manual_seed(seed)
    m = ReferenceRanker(dim=16, heads=2, layers=layers, encoder=encoder, window=window, attention=attention, block=8)
    return m.to(dtype).eval()


def _events(g: torch.Generator, n: int, *, time0: int = 0) -> Events:
    return Events(item=torch.randint(0, 1 << 20, (n,), generator=g), side=torch.randint(0, 1 << 20, (n, 2), generator=g),
                  action=torch.randint(1, 8, (n,), generator=g),
                  time=time0 + torch.cumsum(torch.randint(1, 500, (n,), generator=g), 0))


def _cands(g: torch.Generator, c: int) -> Candidates:
    return Candidates(item=torch.randint(0, 1 << 20, (c,), generator=g), side=torch.randint(0, 1 << 20, (c, 2),
                                                                                          generator=g))


CASES = [("sample", 1, None), ("sample", 2, None), ("window", 1, 3), ("window", 2, 4), ("none", 1, None)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("encoder,layers,window", CASES, ids=[f"{e}-{n}L-W{w}" for e, n, w in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_equals_the_full_recompute(encoder, layers, window, dtype, seed):
    model = _model(encoder, layers=layers, window=window, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    P, L = int(rng.choice([3, 4, 5])), int(rng.integers(5, 9))
    history = _events(g, int(rng.integers(0, 25)))
    cands = _cands(g, 6)
    st = prefill(model, history, max_seq_len=L, page_size=P)
    sizes = rng.integers(0, 10, int(rng.integers(1, 9))).tolist()
    sizes[int(rng.integers(len(sizes)))] = 0  # an empty extend, and sizes that are not multiples of P
    held = history
    enc = training_encoder(model)
    for k in sizes:
        new = _events(g, k)
        st, held = extend(model, st, new), held.cat(new)
        assert st.length == len(held) and len(st.pages) == -(-len(held) // P)
        ref = full_scores(model, held, cands, L)
        torch.testing.assert_close(score(model, st, cands), ref, atol=TOL[dtype], rtol=0)
        if len(held):  # the cached target-attention keys and values are the training encoder's
            with torch.no_grad():
                e = enc(held)
                torch.testing.assert_close(st.rows(0, len(held), slice(-2, None)),
                                           torch.stack([model.tk(e), model.tv(e)]), atol=TOL[dtype], rtol=0)


def test_the_request_span_is_the_newest_max_seq_len_events():
    """A history longer than L with a window smaller than it: the oldest events still shape the
    "sample" encoding (so the cache must keep them) but the target sees only the newest L."""
    model = _model("sample", layers=2)
    g = torch.Generator().manual_seed(5)
    history, cands = _events(g, 40), _cands(g, 4)
    st = prefill(model, history, max_seq_len=7, page_size=6)
    torch.testing.assert_close(score(model, st, cands), full_scores(model, history, cands, 7), atol=1e-9, rtol=0)
    changed = Events(history.item.clone(), history.side, history.action)
    changed.item[0] += 1  # outside the span, inside what the encoder sees
    st2 = prefill(model, changed, max_seq_len=7, page_size=6)
    assert not torch.allclose(score(model, st2, cands), score(model, st, cands), atol=1e-6)


def test_an_empty_history_and_a_window_of_two():
    model = _model("window", window=2)
    g = torch.Generator().manual_seed(2)
    cands = _cands(g, 3)
    st = empty_state(model, max_seq_len=4, page_size=4)
    torch.testing.assert_close(score(model, st, cands), full_scores(model, Events.empty(2), cands, 4), atol=1e-9,
                               rtol=0)
    ev = _events(g, 9)
    ref = full_scores(model, ev, cands, 4)
    torch.testing.assert_close(score(model, extend(model, st, ev), cands), ref, atol=1e-9, rtol=0)
    model.attention = "dense"  # the same weights, the dense reference attention (the training forward's
    torch.testing.assert_close(score(model, extend(model, st, ev), cands), ref, atol=1e-9, rtol=0)  # is blocks)


@pytest.mark.parametrize("encoder,window", [("sample", None), ("window", 3)])
def test_scoring_and_extending_never_change_a_state(encoder, window):
    model = _model(encoder, window=window)
    g = torch.Generator().manual_seed(3)
    st = prefill(model, _events(g, 11), max_seq_len=5, page_size=4)
    before = [p.clone() for p in st.pages]
    pages = st.pages
    cands = _cands(g, 5)
    a, b = score(model, st, cands), score(model, st, cands)
    assert torch.equal(a, b)
    st2 = extend(model, st, _events(g, 6))
    assert st.pages is pages and st.length == 11
    assert all(torch.equal(p, q) for p, q in zip(st.pages, before))
    assert st2.pages[:2] == st.pages[:2]  # full pages are shared, the partial one rewritten
    assert st2.pages[2] is not st.pages[2]


def test_the_request_encoder_is_refused_but_has_a_full_recompute():
    model = _model("request")
    g = torch.Generator().manual_seed(4)
    ev, cands = _events(g, 9), _cands(g, 2)
    with pytest.raises(UserwiseError, match="not prefix-stable"):
        prefill(model, ev, max_seq_len=5)
    assert full_scores(model, ev, cands, 5).shape == (2, 2)


def test_a_state_of_another_model_is_refused():
    g = torch.Generator().manual_seed(4)
    st = prefill(_model("sample", layers=1), _events(g, 5), max_seq_len=5, page_size=4)
    with pytest.raises(UserwiseError, match="another model"):
        extend(_model("sample", layers=2), st, _events(g, 2))
    with pytest.raises(UserwiseError, match="integer ids"):
        Events(torch.zeros(3), torch.zeros(3, 2), torch.zeros(3))  # float ids
    with pytest.raises(UserwiseError, match="page boundary"):
        st.truncate(3)


# -- prefix stability ------------------------------------------------------------------


class GRLikeEncoder(nn.Module):
    """A demonstration of what is not cacheable, built like generative-recommenders' HSTU
    input: each event gets the embedding of its reverse position ``n - 1 - i`` and of the time
    bucket of ``ts_last - ts_i``, both relative to the newest event, then the same causal
    blocks as ReferenceRanker's. Every position's input changes when an event is appended."""

    def __init__(self, model: ReferenceRanker, max_len: int = 256, buckets: int = 32):
        super().__init__()
        self.model = model
        self.pos = nn.Embedding(max_len, model.dim).to(next(model.parameters()).dtype)
        self.time = nn.Embedding(buckets, model.dim).to(next(model.parameters()).dtype)
        self.max_len, self.buckets = max_len, buckets

    @torch.no_grad()
    def forward(self, ev: Events) -> torch.Tensor:
        n = len(ev)
        x = self.model.embed_events(ev.item, ev.side, ev.action)
        rev = (n - 1 - torch.arange(n)).clamp(max=self.max_len - 1)
        dt = (ev.time[-1] - ev.time).clamp(min=0) if n else ev.time
        bucket = torch.log2(dt.double() + 1).floor().long().clamp(max=self.buckets - 1)
        x = x + self.pos(rev) + self.time(bucket)
        return self.model.encode(x, torch.tensor([0, n]), None)


def test_the_check_fails_an_encoder_like_generative_recommenders():
    model = _model("sample")
    g = torch.Generator().manual_seed(6)
    ev = _events(g, 20)
    for k in (1, 5):
        r = check_prefix_stable(GRLikeEncoder(model), ev, _events(g, k, time0=int(ev.time[-1])), atol=1e-6)
        assert not r and r.first_changed == 0 and r.max_abs_diff > 1e-3 and r.checked == 20
        with pytest.raises(UserwiseError, match="not prefix-stable"):
            r.raise_if_not()


@pytest.mark.parametrize("encoder,layers,window", CASES, ids=[f"{e}-{n}L-W{w}" for e, n, w in CASES])
def test_the_check_passes_the_cacheable_encoders(encoder, layers, window):
    model = _model(encoder, layers=layers, window=window)
    g = torch.Generator().manual_seed(7)
    ev = _events(g, 23)
    for k in (1, 4, 17):
        r = check_prefix_stable(training_encoder(model), ev, _events(g, k), atol=1e-12)
        assert r and r.first_changed is None and r.checked == 23, r
    assert check_prefix_stable(training_encoder(model), Events.empty(2), _events(g, 3)).ok


def test_the_check_fails_the_request_encoder_once_its_span_moves():
    model = _model("request")
    g = torch.Generator().manual_seed(8)
    ev = _events(g, 6)
    enc = training_encoder(model, max_seq_len=8)
    assert check_prefix_stable(enc, ev, _events(g, 2), atol=1e-12).ok  # the span still starts at 0
    r = check_prefix_stable(enc, ev, _events(g, 3), atol=1e-12)
    assert not r and r.first_changed == 0 and math.isinf(r.max_abs_diff)
