"""The reference model: no leakage (bitwise in float64, zero gradients), user-wise equals
point-wise, and what the causal encoder's output depends on."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import synthetic
from userwise.pipelines.errors import ArgumentError, UserwiseError
from userwise.pipelines.loader import expand_batch
from userwise.pipelines.train import Checkpoint, Fields, PointwiseBatch, ReferenceRanker, UserBatch


def _model(encoder, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("block", 16)
    return ReferenceRanker(dim=16, heads=2, layers=2, encoder=encoder, **kw).to(dtype)


def _cases(batches, n_real=2, n_syn=3):
    real = [UserBatch.from_jagged(b) for b in batches[:n_real]]
    return real + [synthetic(s, samples=8, max_len=6) for s in range(n_syn)]


def _perturbed(ub: UserBatch, n: int, events: torch.Tensor, seed: int) -> UserBatch:
    """``ub`` with the given events and every impression but ``n`` changed (ids, side-info, labels)."""
    g = torch.Generator().manual_seed(seed)
    k = int(events.sum())
    ev_item, ev_side, ev_action = ub.ev_item.clone(), ub.ev_side.clone(), ub.ev_action.clone()
    ev_item[events] = torch.randint(0, 1 << 30, (k,), generator=g)
    ev_side[events] = torch.randint(0, 1 << 30, (k, ev_side.shape[1]), generator=g)
    ev_action[events] = torch.randint(0, 8, (k,), generator=g)
    other = torch.arange(ub.num_impressions) != n
    tgt_item, tgt_side, labels = ub.tgt_item.clone(), ub.tgt_side.clone(), ub.labels.clone()
    tgt_item[other] = torch.randint(0, 1 << 30, (int(other.sum()),), generator=g)
    tgt_side[other] = torch.randint(0, 1 << 30, (int(other.sum()), tgt_side.shape[1]), generator=g)
    labels[other] = 1 - labels[other]
    return UserBatch(ev_item, ev_side, ev_action, tgt_item, tgt_side, labels, ub.spans)


def _invisible(ub: UserBatch, n: int, model: ReferenceRanker) -> torch.Tensor:
    """Events the target n must not depend on: every event at or after its request time (index >=
    its seq_end) and every event of another sample; for the request and none encoders also the events
    before its span, for the window encoder those more than ``reach`` events before it."""
    sp = ub.spans
    k = torch.arange(sp.num_events)
    out = (k >= sp.imp_end[n]) | (sp.event_sample != sp.imp_sample[n])
    if model.encoder in ("request", "none"):
        out |= k < sp.imp_begin[n]
    elif model.encoder == "window":
        out |= k < sp.imp_begin[n] - model.reach
    return out


@pytest.mark.parametrize("encoder", ["sample", "window", "request", "none"])
def test_no_leakage_bitwise_in_float64(long_batches, encoder):
    model = _model(encoder, window=3)
    checked = 0
    for c, ub in enumerate(_cases(long_batches)):
        with torch.no_grad():
            base = model(ub)
        g = torch.Generator().manual_seed(c)
        for n in torch.randperm(ub.num_impressions, generator=g)[:6].tolist():
            inv = _invisible(ub, n, model)
            with torch.no_grad():
                got = model(_perturbed(ub, n, inv, seed=100 * c + n))
            assert torch.equal(got[n], base[n]), (encoder, c, n)
            checked += 1
    assert checked >= 25


def test_no_leakage_the_gradient_of_a_target_is_exactly_zero_on_what_it_cannot_see(long_batches):
    for encoder in ("sample", "request"):
        model = _model(encoder)
        for ub in _cases(long_batches, n_real=1, n_syn=2):
            x = model.embed_events(ub.ev_item, ub.ev_side, ub.ev_action).detach().requires_grad_(True)
            t = model.embed_targets(ub.tgt_item, ub.tgt_side).detach().requires_grad_(True)
            model.embed_events = lambda *a, x=x: x
            model.embed_targets = lambda *a, t=t: t
            out = model(ub)
            for n in range(0, ub.num_impressions, max(1, ub.num_impressions // 5)):
                gx, gt = torch.autograd.grad(out[n].sum(), (x, t), retain_graph=True)
                inv = _invisible(ub, n, model)
                assert torch.equal(gx[inv], torch.zeros_like(gx[inv]))
                others = torch.arange(ub.num_impressions) != n
                assert torch.equal(gt[others], torch.zeros_like(gt[others]))
                vis = ~inv & (torch.arange(ub.spans.num_events) < ub.spans.imp_end[n]) & \
                    (torch.arange(ub.spans.num_events) >= ub.spans.imp_begin[n])
                assert bool(vis.any()) == bool(gx[vis].abs().sum() > 0)  # what it sees does matter
            del model.embed_events, model.embed_targets


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_target_attention_user_wise_equals_point_wise_over_expand_batch_rows(long_batches, demo_batches, dtype, tol):
    model = _model("none", dtype)
    for b in long_batches[:3] + demo_batches[:2]:
        ub = UserBatch.from_jagged(b)
        pb = PointwiseBatch.from_rows(expand_batch(b), Fields.from_roles(b.meta["roles"]))
        with torch.no_grad():
            u, p = model(ub), model.forward_pointwise(pb)
        assert u.shape == (b.num_impressions, 2)
        assert (u - p).abs().max() <= tol
    for s in range(3):
        ub = synthetic(s, samples=10)
        with torch.no_grad():
            assert (model(ub) - model.forward_pointwise(ub.expand("span"))).abs().max() <= tol


def test_the_rows_built_in_torch_are_the_rows_expand_batch_gives(long_batches):
    for b in long_batches[:2]:
        ub = UserBatch.from_jagged(b)
        pb = PointwiseBatch.from_rows(expand_batch(b), Fields.from_roles(b.meta["roles"]))
        mine = ub.expand("span")
        for f in pb.__dataclass_fields__:
            assert torch.equal(getattr(pb, f).to(getattr(mine, f).dtype), getattr(mine, f)), f


def test_the_dense_reference_attention_gives_the_block_model_s_output(long_batches):
    """attention="dense" (the reference) runs the model and agrees with the default "blocks"
    (the model passes its tile, which the dense reference has no use for)."""
    ub = UserBatch.from_jagged(long_batches[0])
    for encoder in ("sample", "window"):
        with torch.no_grad():
            want = _model(encoder, window=3)(ub)
            assert (_model(encoder, window=3, attention="dense")(ub) - want).abs().max() <= 1e-9, encoder


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_the_causal_encoder_equals_its_defined_point_wise_reference(long_batches, dtype, tol):
    """sample: the point-wise row holding the sample's stored events before the request
    (stored[0:end]), the target over its last end - begin; window: the row stored[begin -
    reach:end] under the same window; request: the row expand_batch gives (stored[begin:end])."""
    for b in long_batches[:3]:
        ub = UserBatch.from_jagged(b)
        rows = PointwiseBatch.from_rows(expand_batch(b), Fields.from_roles(b.meta["roles"]))
        for encoder, ref in (("sample", lambda m: ub.expand("prefix")), ("window", lambda m: ub.expand("window", m.reach)),
                             ("request", lambda m: rows)):
            model = _model(encoder, dtype, window=3)
            with torch.no_grad():
                assert (model(ub) - model.forward_pointwise(ref(model))).abs().max() <= tol, encoder


def test_the_sample_encoder_differs_from_truncation_exactly_where_a_span_starts_late(long_batches):
    """Per-request truncation (point-wise rows of stored[begin:end]) equals the sample encoder for the
    impressions whose span starts at the sample's first event, and not for the others: there the
    encoder also saw the events before begin."""
    model = _model("sample")
    late_seen = 0
    for b in long_batches[:3]:
        ub = UserBatch.from_jagged(b)
        sp = ub.spans
        with torch.no_grad():
            d = (model(ub) - model.forward_pointwise(ub.expand("span"))).abs().amax(1)
        late = sp.imp_begin > sp.seq_offsets[:-1][sp.imp_sample]
        assert bool((d[~late] <= 1e-9).all())
        assert bool((d[late] > 1e-6).all())
        late_seen += int(late.sum())
    assert late_seen > 10


def test_model_options_are_checked():
    with pytest.raises(UserwiseError, match="window"):
        ReferenceRanker(encoder="window")
    with pytest.raises(UserwiseError, match="encoder"):
        ReferenceRanker(encoder="bidirectional")
    with pytest.raises(UserwiseError, match="side-info"):
        ReferenceRanker(side_features=3)(synthetic(0))


@pytest.mark.parametrize("kw", [dict(encoder="sample"), dict(encoder="window", window=3, side_features=1),
                                dict(encoder="none", num_labels=3, block=4)])
def test_a_checkpoint_gives_back_the_model_it_saved(tmp_path, kw):
    """model.save then Checkpoint.read / ReferenceRanker.load: the same config, weights and
    logits; the extra values and the version come back; nothing is left beside the file."""
    torch.manual_seed(3)
    model = ReferenceRanker(dim=16, heads=2, layers=2, **{"block": 8, **kw})
    ub = synthetic(1, samples=4, max_len=5, side=len(model.side))
    path = tmp_path / "ck.pt"
    model.save(path, version="v7", step=12, opt={"lr": 1e-3})
    ck = Checkpoint.read(path)
    assert ck.config == model.config() and ck.version == "v7" and ck.extra == {"step": 12, "opt": {"lr": 1e-3}}
    assert ck.parameters <= sum(p.numel() for p in model.parameters())
    for back in (ck.model(), ReferenceRanker.load(path)):
        assert back.config() == model.config()
        assert torch.equal(back(ub), model(ub))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]
    model.save(path)  # no version: the file's sha256 names it
    assert Checkpoint.read(path).version.startswith("sha256:") and Checkpoint.read(path).extra == {}
    with pytest.raises(ArgumentError, match="state_dict"):
        model.save(path, state_dict={})


def test_a_damaged_checkpoint_is_one_error_before_a_model_is_built(tmp_path):
    model = ReferenceRanker(dim=8, heads=2, layers=1)
    torch.save({"config": {**model.config(), "layers": 100_000}, "state_dict": model.state_dict()}, tmp_path / "a.pt")
    with pytest.raises(UserwiseError, match="its weights hold"):
        Checkpoint.read(tmp_path / "a.pt")
    torch.save({"config": {**model.config(), "dim": 2.5}, "state_dict": model.state_dict()}, tmp_path / "b.pt")
    with pytest.raises(UserwiseError, match="config dim"):
        Checkpoint.read(tmp_path / "b.pt")
    torch.save({"state_dict": model.state_dict()}, tmp_path / "c.pt")
    with pytest.raises(UserwiseError, match="holds {'config'"):
        Checkpoint.read(tmp_path / "c.pt")
    (tmp_path / "d.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserwiseError, match="not a torch checkpoint"):
        Checkpoint.read(tmp_path / "d.pt")
    with pytest.raises(UserwiseError, match="no such checkpoint"):
        Checkpoint.read(tmp_path / "e.pt")
    torch.save({"config": {**model.config(), "num_labels": 1}, "state_dict": model.state_dict()}, tmp_path / "f.pt")
    ck = Checkpoint.read(tmp_path / "f.pt")  # its weights hold enough, but they are another model's
    with pytest.raises(UserwiseError, match="do not make a ReferenceRanker"):
        ck.model()


def test_an_empty_batch_gives_an_empty_output_and_a_zero_loss_with_gradients():
    ub = synthetic(0)
    sp = ub.spans
    from userwise.pipelines.train import Spans
    z = torch.zeros(1, dtype=torch.long)
    empty = Spans.from_arrays(seq_offsets=z, req_offsets=z, req_begin=z[:0], req_end=z[:0], imp_offsets=z, imp_req=z[:0])
    eb = UserBatch(ub.ev_item[:0], ub.ev_side[:0], ub.ev_action[:0], ub.tgt_item[:0], ub.tgt_side[:0], ub.labels[:0],
                   empty)
    model = _model("sample", torch.float32)
    out = model(eb)
    loss = model.loss(out, eb.labels)
    loss.backward()
    assert out.shape == (0, 2) and float(loss.detach()) == 0.0
    assert all(p.grad is not None for p in model.parameters())
    del sp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/device_check.sh)")
def test_on_cuda_the_model_and_stochastic_length_agree_with_the_host(long_batches):
    from userwise.pipelines.train import stochastic_length

    b = long_batches[0]
    host, dev = UserBatch.from_jagged(b), UserBatch.from_jagged(b.to("cuda"))
    for encoder in ("sample", "request"):
        model = _model(encoder)
        with torch.no_grad():
            u_host, u_dev = model(host), model.cuda()(dev)
            p_dev = model.forward_pointwise(dev.expand("prefix" if encoder == "sample" else "span"))
        assert (u_dev.cpu() - u_host).abs().max() <= 1e-9
        assert (u_dev - p_dev).abs().max() <= 1e-9
    s_host = stochastic_length(b, max_len=8, alpha=1.5, seed=4)
    s_dev = stochastic_length(b.to("cuda"), max_len=8, alpha=1.5, seed=4)
    for name in ("seq.offsets", "req_seq_begin", "req_seq_end", "seq_item", "num_events"):
        assert torch.equal(s_dev[name].cpu(), s_host[name]), name
