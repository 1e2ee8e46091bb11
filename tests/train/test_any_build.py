"""A model from any build: the trainer's side reads a batch's columns from the build's roles,
never from the synthetic log's names. On samples of one side-info feature and three labels
(shardgen, without Spark) ReferenceRanker.for_batch trains, where a model of the demo's
shape is refused with a UserwiseError, not a torch error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.train.helpers import jagged_batches, shard_set
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.train import Fields, ReferenceRanker, UserBatch


@pytest.fixture(scope="module")
def other_roles(tmp_path_factory):
    root = shard_set(str(tmp_path_factory.mktemp("other_roles")), max_seq_len=20, samples=60, seed=3,
                     item_features=1, labels=3)
    return jagged_batches(root, batch_size=16)


def test_the_batch_carries_the_builds_roles(other_roles):
    roles = other_roles[0].meta["roles"]
    assert len(roles["item_features"]) == 1 and len(roles["labels"]) == 3
    f = Fields.from_roles(roles)
    assert len(f.side) == 1 and len(f.labels) == 3 and all(c in other_roles[0] for c in f.labels)


def test_fields_have_no_defaults():
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(Fields))
    with pytest.raises(TypeError):
        Fields()


def test_for_batch_sizes_the_model_from_the_roles_and_it_trains(other_roles):
    torch.manual_seed(0)
    batch = other_roles[0]
    model = ReferenceRanker.for_batch(batch, dim=16, heads=2, item_buckets=64, side_buckets=16)
    assert len(model.side) == 1 and model.head[-1].out_features == 3
    assert {p.device for p in model.parameters()} == {batch.device}  # the batch's device
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ubs = [UserBatch.from_jagged(b) for b in other_roles]
    losses = []
    for step in range(40):
        ub = ubs[step % len(ubs)]
        out = model(ub)
        assert out.shape == (ub.num_impressions, 3)
        loss = model.loss(out, ub.labels)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(float(loss.detach()))
    first, last = sum(losses[:len(ubs)]) / len(ubs), sum(losses[-len(ubs):]) / len(ubs)
    assert last < first, (first, last)
    # the same from the model's input
    assert ReferenceRanker.for_batch(ubs[0], dim=16).head[-1].out_features == 3


def test_a_model_of_other_roles_is_refused_naming_for_batch(other_roles):
    ub = UserBatch.from_jagged(other_roles[0])
    with pytest.raises(UserwiseError, match="side-info features.*for_batch"):
        ReferenceRanker(dim=16, side_features=2, num_labels=3)(ub)
    model = ReferenceRanker(dim=16, side_features=1, num_labels=2)
    with pytest.raises(UserwiseError, match="3 labels.*for_batch"):
        model.loss(model(ub), ub.labels)
    with pytest.raises(UserwiseError, match="from the batch"):
        ReferenceRanker.for_batch(other_roles[0], dim=16, num_labels=2)


def test_for_roles_sizes_a_model_before_the_first_batch(other_roles, tmp_path):
    """DDP needs the model before the loop: the dataset's roles size it as a batch would."""
    from userwise.pipelines.loader import UserwiseDataset

    root = shard_set(str(tmp_path / "S"), max_seq_len=20, samples=20, seed=3, item_features=1, labels=3)
    roles = UserwiseDataset(root, device="cpu").roles
    assert roles == other_roles[0].meta["roles"]
    a = ReferenceRanker.for_roles(roles, dim=16)
    b = ReferenceRanker.for_batch(other_roles[0], dim=16)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    with pytest.raises(UserwiseError, match="from the roles"):
        ReferenceRanker.for_roles(roles, dim=16, side_features=2)
