"""Training on the demo's samples: user-wise and point-wise from the same seed."""

from __future__ import annotations

import torch

from userwise.pipelines.loader import expand_batch
from userwise.pipelines.train import Fields, PointwiseBatch, ReferenceRanker, UserBatch

STEPS = 300


def _train(batches, encoder: str, pointwise: bool) -> list[float]:
    torch.manual_seed(0)
    # small hashed tables: ids collide, so the model learns the labels' rates instead of memorising
    # the few batches it cycles through (shardgen's labels are random)
    model = ReferenceRanker(dim=16, heads=2, layers=1, encoder=encoder, block=32, item_buckets=64,
                            side_buckets=16).double()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        ub, pb = batches[step % len(batches)]
        out = model.forward_pointwise(pb) if pointwise else model(ub)
        loss = model.loss(out, ub.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _inputs(demo_batches):
    out = []
    for b in demo_batches:
        rows = expand_batch(b)  # the point-wise rows of the same impressions
        out.append((UserBatch.from_jagged(b), PointwiseBatch.from_rows(rows, Fields.from_roles(b.meta["roles"]))))
    return out


def _falls(losses):
    return sum(losses[-50:]) / 50 < sum(losses[:20]) / 20 - 0.05


def test_user_wise_and_point_wise_training_track_each_other_and_both_fall(demo_batches):
    data = _inputs(demo_batches)
    assert sum(ub.num_impressions for ub, _ in data) > 500
    # the request encoder computes what point-wise rows compute: the losses agree step by step
    uw, pw = _train(data, "request", False), _train(data, "request", True)
    assert max(abs(a - b) for a, b in zip(uw, pw)) <= 1e-6
    assert _falls(uw) and _falls(pw)
    # the sample encoder (one pass per sample) is another model than truncated rows: the losses
    # track each other within 5% over the last 50 steps, and both fall
    us = _train(data, "sample", False)
    last_u, last_p = sum(us[-50:]) / 50, sum(pw[-50:]) / 50
    assert abs(last_u - last_p) <= 0.05 * last_p, (last_u, last_p)
    assert _falls(us)
