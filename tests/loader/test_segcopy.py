"""The segmented copy behind batch assembly: compiled (numba) and numpy agree with the definition."""

import numpy as np
import pytest
import torch

from userwise.pipelines.loader.assembly import segcopy
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import UserwiseLoader
from userwise.pipelines.tools.shardgen import write_shard_set


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    """Short and long sequences (up to a few hundred events), strings, a nullable column."""
    root = str(tmp_path_factory.mktemp("segshards"))
    write_shard_set(root, nodes=1, ranks_per_node=1, row_group_rows=16, event_scale=40.0, max_events=400,
                    max_seq_len=128)
    return root


def reference(src, starts, lengths):
    return np.concatenate([src[s: s + n] for s, n in zip(starts, lengths)] or [src[:0]])


@pytest.fixture(params=["numba", "numpy"])
def impl(request, monkeypatch):
    if request.param == "numba":
        assert segcopy.implementation() == "numba", "numba is in the loader's extra: the compiled path must be used"
    else:
        monkeypatch.setattr(segcopy, "_IMPL", ("numpy", segcopy._numpy_copy, "test"))
    return request.param


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint16", "float16", "float32", "float64"])
def test_seg_copy_matches_the_definition(impl, dtype):
    rng = np.random.default_rng(7)
    src = (rng.standard_normal(5000) * 1000).astype(dtype)
    # runs of every size: empty, short (element loop), long (block copy), overlapping, out of order
    lengths = rng.choice([0, 1, 3, 31, 32, 33, 200, 1500], size=60)
    starts = rng.integers(0, len(src) - lengths)
    want = reference(src, starts, lengths)
    out = np.full(len(want) + 5, 99, dtype)  # longer than needed: the tail stays untouched
    segcopy.seg_copy(src, starts.astype(np.int64), lengths.astype(np.int64), out)
    assert out[: len(want)].tobytes() == want.tobytes()
    assert (out[len(want):] == 99).all()
    # into a row of a 2-D block (how batches are assembled)
    block = np.zeros((3, len(want) + 8), dtype)
    segcopy.seg_copy(src, starts.astype(np.int64), lengths.astype(np.int64), block[1, : len(want)])
    assert block[1, : len(want)].tobytes() == want.tobytes() and not block[[0, 2]].any()
    # strided ends (a column of a 2-D block, every other element): the block copy cannot take them
    wide = np.zeros((len(want) + 8, 2), dtype)
    segcopy.seg_copy(src, starts.astype(np.int64), lengths.astype(np.int64), wide[: len(want), 1])
    assert wide[: len(want), 1].tobytes() == want.tobytes() and not wide[:, 0].any() and not wide[len(want):].any()
    got = np.zeros(len(want), dtype)
    segcopy.seg_copy(src.repeat(2)[::2], starts.astype(np.int64), lengths.astype(np.int64), got)
    assert got.tobytes() == want.tobytes()


def test_seg_copy_of_nothing(impl):
    out = np.zeros(3, np.int64)
    segcopy.seg_copy(np.arange(5), np.zeros(0, np.int64), np.zeros(0, np.int64), out)
    assert (out == 0).all()


def test_compiled_copies_refuse_ranges_outside_their_arrays():
    """The compiled copies are memcpy, which checks nothing: a run outside the source or past
    the output (a corrupt offset) is an error, not a read or write of foreign memory."""
    assert segcopy.implementation() == "numba"
    src, one = np.arange(10, dtype=np.int64), np.ones(1, np.int64)
    for starts, lengths, n_out in (([5], [20], 40), ([-1], [20], 40), ([0], [20], 10)):
        with pytest.raises(IndexError):
            segcopy.seg_copy(src, np.array(starts, np.int64), np.array(lengths, np.int64), np.zeros(n_out, np.int64))
    segcopy.seg_copy(src, 0 * one, 10 * one, np.zeros(10, np.int64))  # exactly fitting is fine
    nb = segcopy.batch_kernels()
    ops = np.array([nb.OpRow(nb.Op.VALUES, 0, 0, 0, 1, -1, -1)], np.int64)  # samples [a, b) of a 1-byte column
    bsrc, isrc = nb.byte_sources([np.arange(4, dtype=np.uint8)]), nb.int_sources([np.zeros(1, np.int64)])
    pos, numel = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for b, ok in ((4, True), (10, False)):  # 10 samples of a 4-byte column: past the source
        total = nb.batch_layout(ops, 0, b, isrc.table, 64, pos, numel)
        out = np.zeros(total, np.uint8)
        if ok:
            nb.batch_fill(out, ops, 0, b, bsrc.table, isrc.table, pos, numel, 64, total)
            assert out[:4].tolist() == [0, 1, 2, 3]
        else:
            with pytest.raises(IndexError):
                nb.batch_fill(out, ops, 0, b, bsrc.table, isrc.table, pos, numel, 64, total)


def test_string_runs_kernel_matches_the_definition_and_checks_its_ranges():
    """perm_strings (the shuffle of a group's string columns, one block copy per run and
    column) against plain Python: empty strings, empty runs, long strings (the memcpy branch),
    a subset of the runs in another order, a read-only source; out-of-range runs or offsets
    are an IndexError."""
    nb = segcopy.batch_kernels()
    assert nb is not None
    rng = np.random.default_rng(5)
    cols = [[("s" * int(k)).encode() for k in rng.choice([0, 1, 3, 40], 30)] for _ in range(3)]
    data = np.frombuffer(b"".join(b"".join(c) for c in cols), np.uint8)  # read-only, as from Arrow
    base = np.cumsum([0] + [sum(map(len, c)) for c in cols])
    soff = np.stack([b + np.concatenate([[0], np.cumsum([len(x) for x in c])]) for b, c in zip(base, cols)])
    starts, lengths = np.array([20, 0, 7, 29, 12], np.int64), np.array([6, 0, 5, 1, 0], np.int64)
    elems = [k for s, n in zip(starts, lengths) for k in range(s, s + n)]
    want = [[cols[c][k] for k in elems] for c in range(3)]
    out, out_soff = np.empty(len(data), np.uint8), np.empty((3, len(elems) + 1), np.int64)
    n = nb.perm_strings(data, soff, starts, lengths, out, out_soff)
    got = [[out[out_soff[c, j]: out_soff[c, j + 1]].tobytes() for j in range(len(elems))] for c in range(3)]
    assert got == want and n == sum(map(len, sum(want, []))) and out_soff[2, -1] == n
    e = np.empty(len(elems), np.int64)
    assert nb.ranges(starts, lengths, e) == len(elems) and e.tolist() == elems
    bad_off = soff.copy()
    bad_off[1, 21] = len(data) + 5  # a corrupt string offset pointing past the bytes
    for args in ((data, soff, np.array([28]), np.array([5]), out, out_soff),  # run past the column
                 (data, soff, starts, lengths, out[:10], out_soff),  # bytes past the output
                 (data, soff, starts, lengths, out, out_soff[:, :4]),  # offsets past the output
                 (data, bad_off, np.array([20]), np.array([2]), out, out_soff)):
        with pytest.raises(IndexError):
            nb.perm_strings(*args)
    with pytest.raises(IndexError):
        nb.ranges(starts, lengths, e[:3])


@pytest.mark.parametrize("run_copy_min", [0, None])
def test_loader_batches_are_the_same_bytes_with_either_copy(shardset, monkeypatch, run_copy_min):
    """Whole epochs (strings, validity, long and short lists) assembled by the compiled batch
    kernels and by numpy are byte-identical (every list group copied by runs, or the default
    choice of runs and gathered blocks)."""
    from userwise.pipelines.loader.assembly import stacked
    from userwise.pipelines.loader.assembly.program import BatchProgram

    assert segcopy.batch_kernels() is not None, "numba is in the loader's extra: the batch kernels must compile"

    def epoch(which):
        if which == "numpy":
            monkeypatch.setattr(segcopy, "_IMPL", ("numpy", segcopy._numpy_copy, "test"))
        if run_copy_min is not None:
            monkeypatch.setattr(stacked, "RUN_COPY_MIN", run_copy_min)
        calls.clear()
        ds = UserwiseDataset(shardset, batch_size=5, verify="none", world_size=1, rank=0, seed=11)
        out = [(b.spec, b.buffer.clone(), b.meta["events"], b.meta["impressions"]) for b in UserwiseLoader(ds)]
        return out, len(calls)

    calls = []
    compiled_fn = BatchProgram.run
    monkeypatch.setattr(BatchProgram, "run", lambda *a: calls.append(1) or compiled_fn(*a))
    (compiled, n_compiled), (plain, n_plain) = epoch("numba"), epoch("numpy")
    assert n_compiled == len(compiled) and n_plain == 0  # each side took the path it is meant to
    assert len(compiled) == len(plain) > 3
    for (s1, b1, *m1), (s2, b2, *m2) in zip(compiled, plain):
        assert s1 == s2 and torch.equal(b1, b2) and m1 == m2


def test_without_numba_the_numpy_copy_is_chosen():
    """USERWISE_NO_NUMBA=1 (or numba missing) falls back to numpy, in a fresh process."""
    import os
    import subprocess
    import sys

    code = ("from userwise.pipelines.loader.assembly import segcopy; import numpy as np; "
            "o = np.zeros(4, np.int64); segcopy.seg_copy(np.arange(10), np.array([7, 1]), np.array([2, 2]), o); "
            "print(segcopy.implementation(), o.tolist())")
    env = dict(os.environ, USERWISE_NO_NUMBA="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["numpy", "[7,", "8,", "1,", "2]"]


def every_kind_of_column(n: int = 57) -> dict:
    """Decoded columns of every kind the layout has: sample scalars and strings (with nulls),
    parallel seq lists (with nulls, empty lists), request lists with strings, impressions with
    req_num_imps, and a list column with its own offsets."""
    import pyarrow as pa

    from userwise.pipelines.loader.io import decode

    rng = np.random.default_rng(3)
    num_events = rng.choice([0, 1, 2, 40, 300], n)
    req_len = rng.integers(0, 4, n)
    rni = [rng.integers(0, 3, k).astype(np.int32) for k in req_len]
    rows = {
        "sample_id": pa.array(np.arange(n, dtype=np.int64)),
        "kind": pa.array([None if i % 7 == 0 else "x" * (i % 5) for i in range(n)]),
        "weight": pa.array([None if i % 4 == 0 else float(i) for i in range(n)], pa.float32()),
        "seq_item": pa.array([rng.integers(0, 1 << 40, k).tolist() for k in num_events], pa.list_(pa.int64())),
        "seq_cat": pa.array([[None if (j + i) % 9 == 0 else j for j in range(k)] for i, k in enumerate(num_events)],
                            pa.list_(pa.int32())),
        "seq_flag": pa.array([rng.integers(0, 2, k).astype(np.int8).tolist() for k in num_events], pa.list_(pa.int8())),
        "req_id": pa.array([[f"r{i}-{j}" for j in range(k)] for i, k in enumerate(req_len)], pa.list_(pa.string())),
        "req_num_imps": pa.array([x.tolist() for x in rni], pa.list_(pa.int32())),
        "imp__item": pa.array([rng.integers(0, 99, int(x.sum())).tolist() for x in rni], pa.list_(pa.int64())),
        "tags": pa.array([list(range(i % 6)) for i in range(n)], pa.list_(pa.int16())),
    }
    return decode.from_arrow(pa.table(rows))


def test_batch_kernels_equal_numpy_on_every_kind_of_column(monkeypatch):
    """A buffer with every column kind the layout has: sample scalars and strings (with
    nulls), parallel seq lists (with nulls, empty lists), request lists with strings,
    impressions with req_num_imps, and a list column with its own offsets. Batches cut from
    the permuted buffer by the compiled kernels and by numpy are the same bytes, for ranges
    that include empty samples and the empty range, with runs and with gathered blocks."""
    from userwise.pipelines.loader.assembly import stacked
    from userwise.pipelines.loader.assembly.assemble import Prepared

    rng = np.random.default_rng(3)
    n = 57
    cols = every_kind_of_column(n)
    perm = rng.permutation(n)
    cuts = [(0, 5), (5, 5), (5, 23), (23, 40), (40, n)]

    def batches():
        src = Prepared(cols).permuted(perm)
        assert (src.program is None) == (segcopy.batch_kernels() is None)
        return [src.assemble_range(a, b, lambda k: torch.empty(k, dtype=torch.uint8), {}) for a, b in cuts]

    for run_copy_min in (0, 10_000):  # every list group by runs / every one gathered
        monkeypatch.setattr(stacked, "RUN_COPY_MIN", run_copy_min)
        compiled = batches()
        with monkeypatch.context() as m:
            m.setattr(segcopy, "_IMPL", ("numpy", segcopy._numpy_copy, "test"))
            plain = batches()
        for c, p in zip(compiled, plain):
            assert c.spec == p.spec and torch.equal(c.buffer, p.buffer)
            assert (c.meta["events"], c.meta["impressions"]) == (p.meta["events"], p.meta["impressions"])
    assert "tags.offsets" in {s[0] for s in compiled[0].spec}  # the own-offsets list group is there


def test_an_empty_batch_is_made_from_the_layout_alone():
    """A rank with fewer samples than batches gets empty batches: made from the buffer layout
    alone (no samples gathered), they are the same bytes, spec and counts as an empty range cut
    from a buffer of that layout (compiled or numpy) and as the device assembler's gather of no
    samples, on host and (through ``empty_layout``) device columns alike."""
    from userwise.pipelines.loader.assembly import assemble_torch
    from userwise.pipelines.loader.assembly.assemble import Prepared, empty_batch, empty_layout
    from userwise.pipelines.loader.io import decode

    cols = every_kind_of_column()
    alloc = lambda k: torch.full((k,), 7, dtype=torch.uint8)  # noqa: E731 (stale bytes: all must be written)
    meta = {"index": 3}
    got = empty_batch(empty_layout(cols), alloc, meta)
    cut = Prepared(cols).permuted(np.arange(57)).assemble_range(5, 5, alloc, meta)
    gathered = assemble_torch.assemble(decode.torch_cols(cols), torch.zeros(0, dtype=torch.long), alloc, meta)
    assert got.num_samples == 0 and got.spec == cut.spec == gathered.spec
    assert bytes(got.buffer.numpy()) == bytes(cut.buffer.numpy()) == bytes(gathered.buffer.numpy())
    assert got.meta["columns"] == cut.meta["columns"] == gathered.meta["columns"]
    assert (got.meta["events"], got.meta["impressions"]) == (0, 0) and got.meta["index"] == 3
    assert empty_layout(decode.torch_cols(cols)) == empty_layout(cols)  # torch columns: the same layout
    assert {"seq.offsets", "tags.offsets", "kind.soff", "imp.req"} <= {s[0] for s in got.spec}
