"""Stochastic length: a seeded sub-sampling per sample; every span follows the same choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.jagged import ranges
from userwise.pipelines.loader import expand_batch
from userwise.pipelines.train import ReferenceRanker, UserBatch, spans, stochastic_length
from userwise.pipelines.train.stochastic import keep_mask

N, ALPHA = 8, 1.5  # the long set's max_seq_len; keeps int(8 ** 0.75) = 4 events of a cut sample


def test_a_dropped_event_is_invisible_to_every_request_and_spans_keep_the_rest_in_order(long_batches):
    cut_samples = 0
    for b in long_batches:
        keep = keep_mask(b["seq.offsets"], b["sample_id"], max_len=N, alpha=ALPHA, seed=5)
        s = stochastic_length(b, max_len=N, alpha=ALPHA, seed=5)
        old, new = spans(b), spans(s)
        # every impression now sees exactly the kept events of its old span, in order
        idx = ranges(old.imp_begin, old.imp_end - old.imp_begin)
        owner = torch.repeat_interleave(torch.arange(old.num_impressions), old.imp_end - old.imp_begin)
        k = keep[idx]
        want_ts, want_owner = b["seq_ts"][idx][k], owner[k]
        got_idx = ranges(new.imp_begin, new.imp_end - new.imp_begin)
        got_owner = torch.repeat_interleave(torch.arange(new.num_impressions), new.imp_end - new.imp_begin)
        assert torch.equal(s["seq_ts"][got_idx], want_ts) and torch.equal(got_owner, want_owner)
        for f in ("seq_item", "seq_category", "seq_author", "seq_action"):
            assert torch.equal(s[f], b[f][keep])
        # the stored sequence is exactly the kept events; counts follow
        n_old, n_new = torch.diff(b["seq.offsets"]), torch.diff(s["seq.offsets"])
        assert torch.equal(n_new, torch.bincount(old.event_sample[keep], minlength=old.num_samples))
        assert torch.equal(s["num_events"].long(), n_new) and torch.equal(b["cost"] - s["cost"], n_old - n_new)
        cut = n_new < n_old
        assert bool((n_new[cut] == int(N ** (ALPHA / 2))).all())   # a cut sample keeps N^(alpha/2) events
        assert bool((n_old[cut] > int(N ** (ALPHA / 2))).all())    # only longer samples are cut
        cut_samples += int(cut.sum())
        # the rows expand_batch gives are the old rows' histories without the dropped events
        rows = expand_batch(s)
        assert np.array_equal(np.asarray(rows.column("seq_item").combine_chunks().values),
                              b["seq_item"][idx][k].numpy())
        assert rows.column("item_id").equals(expand_batch(b).column("item_id"))
    assert cut_samples >= 5


def test_the_draw_is_seeded_per_sample_not_per_batch(long_set, long_batches):
    from tests.train.helpers import jagged_batches

    def kept(batches, seed, epoch=0):
        out = {}
        for b in batches:
            k = keep_mask(b["seq.offsets"], b["sample_id"], max_len=N, alpha=ALPHA, seed=seed, epoch=epoch)
            so = b["seq.offsets"].long()
            for i, sid in enumerate(b["sample_id"].tolist()):
                out[sid] = k[so[i]:so[i + 1]].tolist()
        return out

    a = kept(long_batches, 1)
    assert a == kept(jagged_batches(long_set, batch_size=5, seed=9), 1)  # other batches, same choice
    assert a != kept(long_batches, 2) and a != kept(long_batches, 1, epoch=1)


def test_the_share_of_cut_samples_follows_hstu():
    n = 40  # events per sample; cut with probability 1 - N^alpha / n^2
    so = torch.arange(0, 4001 * n, n)
    sid = torch.arange(4000) * 7919 + 11
    keep = keep_mask(so, sid, max_len=N, alpha=ALPHA, seed=0)
    cut = torch.bincount(torch.arange(so[-1]) // n, weights=(~keep).double()) > 0
    want = 1 - N ** ALPHA / n ** 2
    assert abs(float(cut.double().mean()) - want) < 0.02


def test_the_model_on_a_stochastic_length_batch_still_cannot_leak(long_batches):
    torch.manual_seed(0)
    model = ReferenceRanker(dim=16, encoder="sample", block=16).double()
    b = stochastic_length(long_batches[2], max_len=N, alpha=ALPHA, seed=3)
    ub = UserBatch.from_jagged(b)
    sp = ub.spans
    with torch.no_grad():
        base = model(ub)
        for n in range(0, sp.num_impressions, 7):
            later = torch.arange(sp.num_events) >= sp.imp_end[n]
            item = ub.ev_item.clone()
            item[later] += 12345
            changed = UserBatch(item, ub.ev_side, ub.ev_action, ub.tgt_item, ub.tgt_side, ub.labels, sp)
            assert torch.equal(model(changed)[n], base[n])


def test_bad_arguments_are_one_line_errors(long_batches):
    b = long_batches[0]
    with pytest.raises(UserwiseError, match="alpha"):
        stochastic_length(b, max_len=N, alpha=2.5)
    with pytest.raises(UserwiseError, match="max_len"):
        stochastic_length(b, max_len=0)
