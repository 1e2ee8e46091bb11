"""Routing users to serving nodes: a jump consistent hash that moves at most its share of users
when a node is added (only to the new node), and the same assignment in any process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.serve import node_of, nodes_of, user_keys
from userwise.schemas.hashing import xxhash64

USERS = 100_000


def test_adding_a_node_moves_at_most_its_share_and_only_to_it():
    users = np.arange(USERS, dtype=np.int64) * 7919 - 3 * USERS  # negative ids too
    prev = nodes_of(users, 1)
    assert (prev == 0).all()
    for n in range(1, 17):
        cur = nodes_of(users, n + 1)
        moved = cur != prev
        assert moved.mean() <= 1 / (n + 1) + 0.01, (n, moved.mean())
        assert moved.mean() >= 1 / (n + 1) - 0.01, (n, moved.mean())  # and it does take its share
        assert (cur[moved] == n).all()  # only to the new node
        counts = np.bincount(cur, minlength=n + 1)
        assert counts.min() > USERS / (n + 1) * 0.9  # balanced
        prev = cur


def test_string_ids_route_by_their_spark_hash():
    names = [f"user-{i}" for i in range(20_000)]
    a, b = nodes_of(names, 8), nodes_of(names, 9)
    moved = a != b
    assert moved.mean() <= 1 / 9 + 0.01 and (b[moved] == 8).all()
    assert user_keys(["u-7", 7]).tolist() == [xxhash64([("u-7", "string")]), xxhash64([(7, "long")])]
    assert node_of(7, 5) == int(nodes_of(np.array([7]), 5)[0]) == int(nodes_of([7], 5)[0])
    with pytest.raises(UserwiseError, match="nodes=0"):
        nodes_of([1], 0)
    with pytest.raises(UserwiseError, match="route int or string"):
        nodes_of([1.5, "a"], 3)


def test_the_assignment_is_the_same_in_another_process():
    code = ("import numpy as np; from userwise.pipelines.serve import nodes_of; "
            "print(nodes_of(np.arange(-500, 500), 13).tolist()); "
            "print(nodes_of([f'u{i}' for i in range(300)], 7).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.splitlines()
    assert out[0] == str(nodes_of(np.arange(-500, 500), 13).tolist())
    assert out[1] == str(nodes_of([f"u{i}" for i in range(300)], 7).tolist())
