"""The jagged helpers the loader and the trainer's side share (pipelines/jagged.py):
each equals its plain definition, on both of its paths (numpy for host tensors, torch ops
for device tensors: run here on CPU tensors by forcing the device path), and pack lays
arrays out as the loader's batches are laid out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from userwise.pipelines import jagged
from userwise.pipelines.loader.assembly.batch import JaggedBatch


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    if request.param == "device":  # the torch ops a CUDA tensor takes, on CPU tensors
        monkeypatch.setattr(jagged, "_host", lambda t: False)
    return request.param


def _cases():
    rng = np.random.default_rng(0)
    yield np.zeros(0, np.int64)
    yield np.array([0, 0, 0])
    for _ in range(5):
        yield rng.integers(0, 6, int(rng.integers(1, 9)))


def test_each_helper_equals_its_definition(path):
    for lengths in _cases():
        t = torch.from_numpy(lengths)
        starts = torch.from_numpy(np.arange(len(lengths)) * 10)
        want_off = [0] + np.cumsum(lengths).tolist()
        off = jagged.offsets(t)
        assert off.dtype == torch.long and off.tolist() == want_off
        assert jagged.np_offsets(lengths).tolist() == want_off
        seg_want = [s for s, n in enumerate(lengths) for _ in range(n)]
        pos_want = [i for n in lengths for i in range(n)]
        assert jagged.segment_ids(off).tolist() == seg_want == jagged.np_segment_ids(off.numpy()).tolist()
        seg, pos = jagged.positions(off)
        assert seg.tolist() == seg_want and pos.tolist() == pos_want
        assert [x.tolist() for x in jagged.np_positions(off.numpy())] == [seg_want, pos_want]
        want_rng = [int(s) + i for s, n in zip(starts, lengths) for i in range(n)]
        assert jagged.ranges(starts, t).tolist() == want_rng == jagged.np_ranges(starts.numpy(), lengths).tolist()
        assert jagged.repeat(starts, t, int(lengths.sum())).tolist() == np.repeat(starts.numpy(), lengths).tolist()
    so, rs = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 0, 2])
    b, e = jagged.request_spans(so, rs, torch.tensor([0, 1, 2]), torch.tensor([2, 3, 4]))
    assert b.tolist() == [0, 1, 5] and e.tolist() == [2, 3, 7]
    nb, ne = jagged.np_request_spans(so.numpy(), rs.numpy(), np.array([0, 1, 2]), np.array([2, 3, 4]))
    assert nb.tolist() == b.tolist() and ne.tolist() == e.tolist()


def test_pack_lays_out_arrays_as_a_batch(path):
    arrays = {"a": torch.arange(3, dtype=torch.int64), "b": torch.tensor([1, 2], dtype=torch.uint8),
              "c": torch.zeros(0, dtype=torch.float32), "d": torch.tensor([1.5], dtype=torch.float16)}
    items = [(n, t.dtype, t.numel(), lambda v, t=t: v.copy_(t)) for n, t in arrays.items()]
    buf, spec = jagged.pack(items, lambda n: torch.full((n,), 255, dtype=torch.uint8))  # garbage to overwrite
    assert [s[2] for s in spec] == [0, 64, 128, 128] and buf.numel() == 192
    assert [s[1] for s in spec] == ["int64", "uint8", "float32", "float16"]
    b = JaggedBatch(buf, spec, {})
    assert all(torch.equal(b[n], t) for n, t in arrays.items())
    used = np.zeros(buf.numel(), bool)
    for _, dt, off, n in spec:
        used[off: off + n * getattr(torch, dt).itemsize] = True
    assert (buf.numpy()[~used] == 0).all()  # padding and tail zeroed: equal arrays, equal bytes
