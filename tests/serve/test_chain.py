"""The chain a cached state is checked against: the vectorised hash equals Spark's
(``schemas.hashing.xxhash64``, the oracle) bit for bit, the chain follows its documented
formula, and on 10k generated users ``longest_valid_prefix`` equals an oracle over the raw
events in every case, while a cache keyed by (user, length) alone serves stale K/V in every
mutated case."""

from __future__ import annotations

import numpy as np
import pytest

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve import Chain, Events, chain_of, chains_of, longest_valid_prefix
from userwise.schemas.hashing import (
    CHAIN_SEED,
    chain_checkpoints,
    event_hashes,
    rolling_hashes,
    xxhash64,
    xxhash64_longs,
)

I64 = np.iinfo(np.int64)
EXTREMES = [0, 1, -1, 2, 42, -42, I64.max, I64.min, I64.max - 1, I64.min + 1, 1 << 32, -(1 << 32), 0xFFFFFFFF]


def _scalar(v, s):
    return xxhash64([(int(v), "long")], seed=int(s))


def test_vectorised_xxhash64_is_spark_s_bit_for_bit():
    rng = np.random.default_rng(0)
    ex = np.array(EXTREMES, dtype=np.int64)
    v, s = np.meshgrid(ex, ex)
    v, s = v.ravel(), s.ravel()
    v = np.concatenate([v, rng.integers(I64.min, I64.max, 20_000, dtype=np.int64, endpoint=True),
                        rng.integers(-1000, 1000, 2000)])
    s = np.concatenate([s, rng.integers(I64.min, I64.max, 20_000, dtype=np.int64, endpoint=True),
                        rng.integers(-1000, 1000, 2000)])
    got = xxhash64_longs(v, s)
    assert got.dtype == np.int64 and got.shape == v.shape
    assert got.tolist() == [_scalar(a, b) for a, b in zip(v.tolist(), s.tolist())]
    assert xxhash64_longs(ex).tolist() == [xxhash64([(int(a), "long")]) for a in ex]  # the default seed: Spark's 42
    assert xxhash64_longs(7).shape == () and int(xxhash64_longs(7)) == _scalar(7, 42)
    assert xxhash64_longs(np.zeros((3, 2), dtype=np.int64)).shape == (3, 2)
    big = rng.integers(I64.min, I64.max, 200_000, dtype=np.int64)  # chunks of 65536 and a remainder
    assert xxhash64_longs(big)[[0, 65535, 65536, 199_999]].tolist() == [_scalar(big[i], 42) for i in
                                                                       (0, 65535, 65536, 199_999)]


def test_event_hashes_fold_each_event_s_fields_as_spark_does():
    rng = np.random.default_rng(1)
    f = np.concatenate([rng.integers(I64.min, I64.max, (300, 4), dtype=np.int64), np.array([EXTREMES[:4]] * 2)])
    want = [xxhash64([(int(x), "long") for x in row]) for row in f]
    assert event_hashes(f).tolist() == want
    assert event_hashes([f[:, i] for i in range(4)]).tolist() == want


def test_rolling_hashes_and_the_chain_follow_the_formula():
    rng = np.random.default_rng(2)
    lens = [0, 3, 200, 1, 5, 0, 150, 17]  # two long tails finish on the scalar path
    off = np.concatenate([[0], np.cumsum(lens)])
    e = rng.integers(I64.min, I64.max, off[-1], dtype=np.int64)
    h = rolling_hashes(e, off)
    for s in range(len(lens)):
        prev = CHAIN_SEED
        for i in range(off[s], off[s + 1]):
            prev = xxhash64([(prev, "long"), (int(e[i]), "long")])  # h_i = xxhash64(h_{i-1}, e_i)
            assert h[i] == prev
    assert rolling_hashes(e[:200]).tolist() == rolling_hashes(e[:200], [0, 200]).tolist()
    many = np.sort(rng.integers(0, off[-1], 40))  # many short sequences: the vectorised path
    assert rolling_hashes(e, np.concatenate([[0], many, [off[-1]]]))[many[5]] == xxhash64(
        [(CHAIN_SEED, "long"), (int(e[many[5]]), "long")])
    # the chain: h after each complete block of P, and the end
    cps, end = chain_checkpoints(h[off[2]:off[3]], 200, 16)
    assert cps.tolist() == [int(h[off[2] + 16 * k - 1]) for k in range(1, 13)] and end == int(h[off[3] - 1])
    assert chain_checkpoints(h[:0], 0, 16)[1] == CHAIN_SEED


def _spark_aggregate(es, P):
    """The docstring's Spark expression, step by step: aggregate(es, (h=42, n=0, cps=[]), ...)."""
    acc = {"h": 42, "n": 0, "cps": []}
    for x in es:
        h = xxhash64([(acc["h"], "long"), (int(x), "long")])
        acc = {"h": h, "n": acc["n"] + 1, "cps": acc["cps"] + [h] if (acc["n"] + 1) % P == 0 else acc["cps"]}
    return acc["cps"], acc["h"]


def test_the_chain_is_what_the_documented_spark_expression_computes():
    rng = np.random.default_rng(3)
    for n, P in [(0, 4), (3, 4), (8, 4), (37, 16), (64, 16)]:
        f = rng.integers(0, 1 << 40, (n, 4))
        c = chain_of(f, block=P, version=1)
        cps, end = _spark_aggregate(event_hashes(f) if n else [], P)
        assert c.checkpoints.tolist() == cps and c.end == end and c.length == n


def test_longest_valid_prefix_cases():
    rng = np.random.default_rng(4)
    f = rng.integers(0, 1 << 40, (70, 3))
    c = lambda rows, v=1: chain_of(rows, block=16, version=v)  # noqa: E731
    assert longest_valid_prefix(c(f[:37]), c(f[:37])) == 37           # unchanged: all of it
    assert longest_valid_prefix(c(f[:37]), c(f[:50])) == 37           # appended: all of it, the partial block too
    assert longest_valid_prefix(c(f[:37]).compact(), c(f[:50])) == 37  # a held chain keeps its end only
    assert longest_valid_prefix(c(f[:5]).compact(), c(f[:6])) == 5     # shorter than a block: kept
    assert longest_valid_prefix(c(f[:37]), c(f[:50]).compact()) == 32  # a current chain without hashes: blocks
    assert longest_valid_prefix(c(f[:32]), c(f[:50])) == 32           # a held state ending on a block
    assert longest_valid_prefix(c(f[:50]), c(f[:37])) == 32           # the current sequence is shorter
    assert longest_valid_prefix(c(f[:37]), c(f[:37], v=2)) == 0       # another model
    g = f.copy()
    g[20, 1] += 1
    assert longest_valid_prefix(c(f[:50]), c(g[:50])) == 16           # changed at 20: the block before it
    assert longest_valid_prefix(c(f[:37]), c(np.concatenate([f[:35], f[36:51]]))) == 32  # one forgotten at 35
    g2 = f.copy()
    g2[4, 0] += 1
    assert longest_valid_prefix(c(f[:5]), c(g2[:6])) == 0             # changed inside a held state under a block
    assert longest_valid_prefix(c(f[:50]), c(f[1:51])) == 0           # re-anchored a day later
    assert longest_valid_prefix(c(f[:0]), c(f[:5])) == 0
    with pytest.raises(UserwiseError, match="page size"):
        longest_valid_prefix(c(f[:5]), chain_of(f[:5], block=8, version=1))
    ev = Events(item=f[:9, 0], side=f[:9, 1:2], action=f[:9, 2])
    a, b = chain_of(ev, block=4, version=0), chain_of(f[:9], block=4, version=0)
    assert a.end == b.end and a.checkpoints.tolist() == b.checkpoints.tolist() and a.length == 9
    assert c(f[:37]).positions() == [16, 32, 37] and c(f[:32]).positions() == [16, 32]
    t = c(f[:37]).truncate(32)
    assert t.length == 32 and t.end == c(f[:32]).end and t.checkpoints.tolist() == c(f[:32]).checkpoints.tolist()
    t = c(f[:50]).truncate(37)  # a chain made from events truncates (and verifies) anywhere
    assert (t.length, t.end, t.checkpoints.tolist()) == (37, c(f[:37]).end, c(f[:37]).checkpoints.tolist())
    assert c(f[:50]).verifies(37) and not c(f[:50]).compact().verifies(37) and c(f[:50]).compact().verifies(32)
    assert c(f[:50]).hash_at(37) == c(f[:37]).end and c(f[:50]).compact().hash_at(50) == c(f[:50]).end
    with pytest.raises(UserwiseError, match="no hash at 37"):
        c(f[:50]).compact().hash_at(37)
    with pytest.raises(UserwiseError, match="hashes"):
        Chain(1, 16, 37, c(f[:37]).checkpoints, c(f[:37]).end, c(f[:36]).hashes)
    with pytest.raises(UserwiseError):
        Chain(1, 16, 37, np.zeros(1, dtype=np.int64), 0)


# -- 10k generated users ---------------------------------------------------------------

KINDS = ("same", "append", "insert", "forget", "forget_some", "gone", "reanchor", "swap")
MUTATED = ("insert", "forget", "forget_some", "reanchor", "swap")  # the control's length check passes: stale


def _generate(n_users: int, seed: int):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 120, n_users)
    held_f = rng.integers(0, 1 << 40, (int(lens.sum()), 4))
    held_off = np.concatenate([[0], np.cumsum(lens)])
    kinds = rng.choice(len(KINDS), n_users)
    new = lambda k: rng.integers(0, 1 << 40, (k, 4))  # noqa: E731
    cur, ver = [], []
    for u in range(n_users):
        h, n, kind = held_f[held_off[u]:held_off[u + 1]], int(lens[u]), KINDS[kinds[u]]
        p = int(rng.integers(0, n))
        k = int(rng.integers(0, 40))
        c = {"same": lambda: h,
             "append": lambda: np.concatenate([h, new(k + 1)]),
             "insert": lambda: np.concatenate([h[:p], new(1), h[p:], new(k)]),        # a late event in the past
             "forget": lambda: new(n + k),                                              # forgotten, came back
             "forget_some": lambda: np.concatenate([h[:p], h[p + 1:], new(k + 1)]),   # one event forgotten
             "gone": lambda: h[:0],                                                     # the user is gone
             "reanchor": lambda: np.concatenate([h[p + 1:], new(p + 1 + k)]),          # the next day's window
             "swap": lambda: np.concatenate([h, new(k)])}[kind]()
        cur.append(c)
        ver.append("v2" if kind == "swap" else "v1")
    cur_off = np.concatenate([[0], np.cumsum([len(c) for c in cur])])
    return held_f, held_off, np.concatenate(cur), cur_off, [KINDS[k] for k in kinds], ver


def _common(held, cur) -> int:
    """How many first events held and current share, event by event."""
    m = min(len(held), len(cur))
    diff = np.flatnonzero((held[:m] != cur[:m]).any(1))
    return int(diff[0]) if len(diff) else m


def _oracle(held, cur, same_version: bool, P: int) -> int:
    """Under the same version: all of held when it is a prefix of cur event by event (the
    current chain knows its hash at every count); else the largest block end n both hold
    (or 0) with held[:n] == cur[:n] event by event."""
    if not same_version:
        return 0
    lcp = _common(held, cur)
    if lcp == len(held):
        return len(held)
    return max(n for n in {*range(P, min(len(held), len(cur)) + 1, P), 0} if n <= lcp)


def test_longest_valid_prefix_equals_the_oracle_on_10k_users_and_a_length_key_is_stale():
    P = 16
    held_f, held_off, cur_f, cur_off, kinds, ver = _generate(10_000, seed=11)
    held = chains_of(held_f, held_off, block=P, versions="v1")
    cur = chains_of(cur_f, cur_off, block=P, versions=ver)
    wrong, stale_control, control_refused, served, partial, full = [], {k: 0 for k in MUTATED}, 0, 0, 0, 0
    for u in range(len(kinds)):
        h, c = held_f[held_off[u]:held_off[u + 1]], cur_f[cur_off[u]:cur_off[u + 1]]
        want = _oracle(h, c, ver[u] == "v1", P)
        got = longest_valid_prefix(held[u], cur[u])
        if got != want or longest_valid_prefix(held[u].compact(), cur[u]) != got:
            wrong.append((u, kinds[u], got, want))
        if kinds[u] in ("same", "append") and got != len(h):  # only appended: the whole held state, any length
            wrong.append((u, kinds[u], got, len(h)))
        served += got
        partial += 0 < got < len(h)  # a prefix of the held state is reused, its tail re-encoded
        full += got == len(h)
        # the control: K/V keyed by (user, length); served when the current sequence is at least as long
        if len(c) >= len(h):
            stale = ver[u] != "v1" or _common(h, c) < len(h)  # it serves all len(h) held events as they are
            if kinds[u] in MUTATED:
                stale_control[kinds[u]] += int(stale)
                assert stale, (u, kinds[u])
            else:
                assert not stale, (u, kinds[u])
        else:
            control_refused += 1
            assert kinds[u] == "gone", (u, kinds[u])
    assert wrong == []
    counts = {k: kinds.count(k) for k in KINDS}
    assert all(v > 1000 for v in counts.values()), counts
    assert stale_control == {k: counts[k] for k in MUTATED}  # stale in every mutated case
    assert control_refused == counts["gone"] and served > 0 and partial > 1000
    assert full >= counts["same"] + counts["append"]
