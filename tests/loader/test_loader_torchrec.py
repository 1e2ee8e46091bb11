"""The jagged batch as a TorchRec KeyedJaggedTensor, fed to real TorchRec modules on CPU."""

from __future__ import annotations

import pytest
import torch

from userwise.pipelines.loader import UserwiseDataset, UserwiseLoader
from userwise.pipelines.tools.shardgen import write_shard_set

torchrec = pytest.importorskip("torchrec")  # installed (torchrec 1.8 + fbgemm-gpu-cpu 1.8) per the lock files


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kjt"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=16,
                    sets=(("incremental", "2026-01-04", "2026-01-05", 40),))
    return next(iter(UserwiseLoader(UserwiseDataset(root, batch_size=12, world_size=1, rank=0))))


def test_kjt_lengths_are_key_major(batch):
    kjt = batch.to_kjt(["seq_item", "seq_category", "imp__item_id"])
    B = batch.num_samples
    so, io = batch["seq.offsets"], batch["imp.offsets"]
    assert kjt.keys() == ["seq_item", "seq_category", "imp__item_id"]
    want = torch.cat([so[1:] - so[:-1], so[1:] - so[:-1], io[1:] - io[:-1]]).int()
    assert torch.equal(kjt.lengths().int(), want) and kjt.stride() == B
    assert torch.equal(kjt["seq_item"].values(), batch["seq_item"].long())
    assert torch.equal(kjt["imp__item_id"].values(), batch["imp__item_id"].long())
    per_req = batch.to_kjt(["seq_item"], per="request")
    rs, b, e = batch["req.sample"], batch["req_seq_begin"].long(), batch["req_seq_end"].long()
    assert torch.equal(per_req.lengths().long(), e - b)
    r = int(torch.argmax(e - b))
    lo = int(so[rs[r]]) + int(b[r])
    vals = per_req["seq_item"].values()
    start = int((e - b)[:r].sum())
    assert torch.equal(vals[start:start + int(e[r] - b[r])], batch["seq_item"][lo:lo + int(e[r] - b[r])].long())
    with pytest.raises(ValueError, match="string"):
        batch.to_kjt(["req_id"])


def test_kjt_feeds_embedding_bag_collection_and_embedding_collection(batch):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    kjt = batch.to_kjt(["seq_item", "seq_category"])
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=5000, feature_names=["seq_item"]),
        EmbeddingBagConfig(name="t_cat", embedding_dim=4, num_embeddings=50, feature_names=["seq_category"]),
    ], device=torch.device("cpu"))
    pooled = ebc(kjt)
    assert pooled.values().shape == (batch.num_samples, 12)
    w = ebc.embedding_bags["t_item"].weight
    so = batch["seq.offsets"]
    i = int(torch.argmax(so[1:] - so[:-1]))
    want = w[batch["seq_item"][so[i]:so[i + 1]].long()].sum(0)
    assert torch.allclose(pooled["seq_item"][i], want, atol=1e-5)
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="t_item2", embedding_dim=8, num_embeddings=5000, feature_names=["seq_item"]),
    ], device=torch.device("cpu"))
    seq = ec(batch.to_kjt(["seq_item"]))
    jt = seq["seq_item"]
    assert jt.values().shape == (int(so[-1]), 8)
    assert torch.equal(jt.lengths().long(), (so[1:] - so[:-1]).long())
