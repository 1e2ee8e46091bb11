"""Kernel layouts: the mask each kernel would apply to what the adapters produce is leak-free,
and the layout a user would write without them is not."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import synthetic
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.train import (
    KernelLayout,
    Spans,
    audit,
    hstu_mha_layout,
    hstu_mha_mask,
    hstu_varlen_layout,
    hstu_varlen_mask,
    spans,
)
from userwise.pipelines.train.kernel_args import FUNC_PAD

LAYOUTS = {
    "hstu_mha": lambda sp: hstu_mha_layout(sp),
    "varlen_targets": lambda sp: hstu_varlen_layout(sp, mode="targets"),
    "varlen_func": lambda sp: hstu_varlen_layout(sp),
    "varlen_func_window": lambda sp: hstu_varlen_layout(sp, encoder="window", window=3),
    "varlen_func_self": lambda sp: hstu_varlen_layout(sp, n_func=5, self_attend=True),
}


def _cases(long_batches):
    return [spans(b) for b in long_batches[:3]] + [synthetic(s).spans for s in range(4)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_gives_each_target_exactly_its_span_and_never_leaks(long_batches, name):
    for sp in _cases(long_batches):
        assert bool((sp.requests_per_sample() > 1).any())  # the case the kernels get wrong
        lay = LAYOUTS[name](sp)
        got = audit(lay, sp)
        assert got == {"spans_exact": True, "no_later_events": True, "no_other_impressions": True,
                       "leak_free": True}, (name, got)


def _naive(sp: Spans) -> KernelLayout:
    """What a user writes for hstu_mha without the adapter: one sequence per sample (stored
    events, then all its impressions), num_targets = impressions per sample."""
    T = sp.seq_offsets[1:] - sp.seq_offsets[:-1]
    K = sp.imp_offsets[1:] - sp.imp_offsets[:-1]
    seq_ev = [torch.arange(int(sp.seq_offsets[s]), int(sp.seq_offsets[s + 1])) for s in range(sp.num_samples)]
    seq_tg = [torch.arange(int(sp.imp_offsets[s]), int(sp.imp_offsets[s + 1])) for s in range(sp.num_samples)]
    ev = torch.cat([torch.cat([e, torch.full((len(t),), -1)]) for e, t in zip(seq_ev, seq_tg)])
    tg = torch.cat([torch.cat([torch.full((len(e),), -1), t]) for e, t in zip(seq_ev, seq_tg)])
    off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(T + K, 0)])
    return KernelLayout("hstu_mha", off, int((T + K).max()), K, ev, tg, False, "naive")


def test_the_layout_without_the_adapter_leaks_and_the_adapter_splits_or_refuses(long_batches):
    sp = spans(long_batches[0])
    got = audit(_naive(sp), sp)
    assert not got["no_later_events"] and not got["spans_exact"]  # an early request's targets see later events
    lay = hstu_mha_layout(sp)
    assert lay.split and lay.num_targets.numel() == sp.num_requests
    with pytest.raises(UserwiseError, match="several requests"):
        hstu_mha_layout(sp, split="refuse")
    with pytest.raises(UserwiseError, match="several requests"):
        hstu_varlen_layout(sp, mode="targets", split="refuse")


def test_samples_of_one_request_are_laid_out_as_they_are():
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    # three samples of one request each; the span is the whole stored sequence (the pointer's invariant)
    sp = Spans.from_arrays(seq_offsets=t([0, 3, 3, 7]), req_offsets=t([0, 1, 2, 3]), req_begin=t([0, 0, 0]),
                           req_end=t([3, 0, 4]), imp_offsets=t([0, 2, 3, 5]), imp_req=t([0, 0, 1, 2, 2]))
    for lay in (hstu_mha_layout(sp), hstu_varlen_layout(sp, mode="targets")):
        assert not lay.split
        assert lay.offsets.tolist() == [0, 5, 6, 12] and lay.num_targets.tolist() == [2, 1, 2]
        assert audit(lay, sp)["leak_free"] and audit(lay, sp)["spans_exact"]
        assert audit(_naive(sp), sp)["leak_free"]  # with one request per sample, num_targets alone is exact
    assert hstu_mha_layout(sp).offsets.dtype == torch.int64
    assert hstu_varlen_layout(sp, mode="targets").offsets.dtype == torch.int32


def test_kernel_masks_follow_the_kernels_semantics_on_hand_written_cases():
    # GR: history h0 h1 h2, targets t0 t1: history causal (and itself), targets see all history and themselves
    m = hstu_mha_mask(torch.tensor([0, 5]), torch.tensor([2])).int().tolist()
    assert m == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 0, 0],
                 [1, 1, 1, 1, 0],
                 [1, 1, 1, 0, 1]]
    # NVIDIA, causal with targets in groups of 2: a target sees the earlier targets of its group only
    m = hstu_varlen_mask(torch.tensor([0, 6], dtype=torch.int32), num_targets=torch.tensor([4]), target_group_size=2,
                         window_size=(-1, 0)).int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],
                 [1, 1, 0, 0, 1, 1]]
    # func rows: [0, f0) | [f1, f2)
    func = torch.tensor([[[1, 0, 2], [0, 1, 0], [0, 3, 0]]], dtype=torch.int32)
    m = hstu_varlen_mask(torch.tensor([0, 3], dtype=torch.int32), func=func).int().tolist()
    assert m == [[1, 0, 0], [0, 1, 1], [1, 1, 0]]


def test_func_layout_arguments_and_values(long_batches):
    sp = spans(long_batches[0])
    lay = hstu_varlen_layout(sp)
    kw = lay.kwargs()
    assert kw["func"].dtype == torch.int32 and kw["func"].shape == (1, 3, lay.total + FUNC_PAD)
    assert kw["seq_offsets_q"].dtype == torch.int32 and kw["num_targets"] is None
    assert kw["window_size"] == (-1, -1) and kw["max_seqlen_q"] == int(torch.diff(lay.offsets.long()).max())
    ev = torch.randn(sp.num_events, 4, dtype=torch.float64)
    tg = torch.randn(sp.num_impressions, 4, dtype=torch.float64)
    vals = lay.values(ev, tg)
    assert torch.equal(lay.targets(vals), tg)
    h = lay.slot_event >= 0
    assert torch.equal(vals[h], ev[lay.slot_event[h]])
    # one sequence per sample: exactly the stored events, each once
    assert torch.equal(torch.sort(lay.slot_event[h]).values, torch.arange(sp.num_events))


def _hstu_reference(x: torch.Tensor, mask: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One HSTU attention layer as the kernels compute it: silu(q k^T) masked, over the slots."""
    q, k, v = (x @ w).chunk(3, -1)
    return (torch.nn.functional.silu(q @ k.T) * mask) @ v / mask.shape[0]


@pytest.mark.parametrize("name", ["hstu_mha", "varlen_func"])
def test_a_target_computed_through_the_kernel_mask_ignores_later_events_and_other_impressions(long_batches, name):
    sp = spans(long_batches[1])
    lay = LAYOUTS[name](sp)
    mask = (hstu_mha_mask(lay.offsets, lay.num_targets) if name == "hstu_mha"
            else hstu_varlen_mask(lay.offsets, func=lay.func)).double()
    g = torch.Generator().manual_seed(0)
    ev, tg = torch.randn(sp.num_events, 8, generator=g, dtype=torch.float64), \
        torch.randn(sp.num_impressions, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 24, generator=g, dtype=torch.float64)
    base = lay.targets(_hstu_reference(lay.values(ev, tg), mask, w))
    for n in torch.randperm(sp.num_impressions, generator=g)[:10].tolist():
        ev2, tg2 = ev.clone(), tg.clone()
        later = torch.arange(sp.num_events) >= sp.imp_end[n]
        ev2[later] = torch.randn(int(later.sum()), 8, generator=g, dtype=torch.float64)
        other = torch.arange(sp.num_impressions) != n
        tg2[other] = torch.randn(int(other.sum()), 8, generator=g, dtype=torch.float64)
        got = lay.targets(_hstu_reference(lay.values(ev2, tg2), mask, w))
        assert torch.equal(got[n], base[n])
