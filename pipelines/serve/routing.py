"""Which serving node holds a user's cache: jump consistent hash of the user id.

A user's K/V live on one node, so every request of the user goes there. The node is
``jump(key(user), nodes)`` (Lamping and Veach's jump consistent hash): a pure function of
the id and the node count (the same in every process and on every host: no Python
``hash``, no randomness), and growing from N to N + 1 nodes moves only the users the new
node takes, ``1 / (N + 1)`` of them in expectation (the others keep their node and their
cache). Nodes are numbered ``0 .. N - 1``; a fleet grows and shrinks at its end.

The key of an int id is Spark's ``xxhash64`` of it as a ``long``, of a string id the hash
of its UTF-8 bytes (:mod:`userwise.schemas.hashing`), so a Spark job can route users with
``xxhash64(user)`` and the same jump.

Example::

    node_of(12345, 8)                       # the node of one user
    nodes_of(np.arange(100_000), 8)         # vectorised over many

A user id is an int (a Python or numpy integer within 64 bits) or a string; :func:`user_id`
is its one normal form, the same for routing and for the cache's key (``1`` and
``np.int64(1)`` are one user; ``True``, ``1.0`` and NaN are refused, never taken for ``1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from userwise.pipelines.errors import ArgumentError, short
from userwise.schemas.hashing import xxhash64, xxhash64_longs

__all__ = ["user_id", "node_of", "nodes_of", "user_keys"]

_JUMP = np.uint64(2862933555777941757)
_LONG = (-(1 << 63), (1 << 63) - 1)


def user_id(user: int | str | np.integer) -> int | str:
    """The one form of a user id, as routing hashes it and the cache keys it: an ``int`` for a
    Python or numpy integer within 64 bits (Spark's ``long``), a ``str`` for a string. A bool,
    a float (NaN included) or anything else is an :class:`ArgumentError`: ``True`` or ``1.0``
    is never taken for the user ``1``.

    Example::

        user_id(np.int64(7)) == user_id(7) == 7      # one user; user_id(7.0) raises
    """
    if isinstance(user, (bool, np.bool_)) or not isinstance(user, (int, np.integer, str)):
        raise ArgumentError(f"user id {short(user)} ({type(user).__name__}): route int or string ids (an int "
                            "within 64 bits, or a string)")
    if isinstance(user, str):
        return str(user)
    v = int(user)
    if not _LONG[0] <= v <= _LONG[1]:
        raise ArgumentError(f"user id {short(user)}: route int or string ids (an int within 64 bits, or a string)")
    return v


def user_keys(users: Sequence[int | str] | np.ndarray) -> np.ndarray:
    """The routing key (int64) of each user id (:func:`user_id`'s form): ``xxhash64(user as long)``
    for ints, ``xxhash64(user as string)`` for strings.

    Example::

        user_keys([7, "u-7"])
    """
    if isinstance(users, np.ndarray) and users.dtype.kind == "i":
        return xxhash64_longs(users.astype(np.int64))
    users = [user_id(u) for u in (users.tolist() if isinstance(users, np.ndarray) else users)]
    if all(type(u) is int for u in users):  # not np.asarray of a mixed list: it would make 7 the string "7"
        return xxhash64_longs(np.array(users, dtype=np.int64))
    out = np.empty(len(users), dtype=np.int64)
    for i, u in enumerate(users):
        out[i] = xxhash64([(u, "long" if isinstance(u, int) else "string")])
    return out


def _jump(keys: np.ndarray, n: int) -> np.ndarray:
    key = keys.view(np.uint64).copy()
    b = np.full(len(key), -1, dtype=np.int64)
    j = np.zeros(len(key), dtype=np.int64)
    active = np.arange(len(key))
    while len(active):
        b[active] = j[active]
        k = key[active] * _JUMP + np.uint64(1)
        key[active] = k
        j[active] = ((b[active] + 1).astype(np.float64) *
                     (float(1 << 31) / ((k >> np.uint64(33)).astype(np.float64) + 1.0))).astype(np.int64)
        active = active[j[active] < n]
    return b


def nodes_of(users: Sequence[int | str] | np.ndarray, nodes: int) -> np.ndarray:
    """The node (int64, ``0 .. nodes - 1``) of each user id (ints or strings).

    Example::

        nodes_of(np.arange(10), 4)
    """
    if int(nodes) < 1:
        raise ArgumentError(f"nodes={nodes}: route to at least one node")
    return _jump(user_keys(users), int(nodes))


def node_of(user: int | str | np.integer, nodes: int) -> int:
    """The node of one user id (int or string).

    Example::

        node_of("u-42", 16)
    """
    return int(nodes_of([user], nodes)[0])
