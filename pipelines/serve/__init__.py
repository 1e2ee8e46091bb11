"""Serving what user-level training learned: a per-user K/V cache that equals a full
recompute and is never stale.

Public names::

    from userwise.pipelines.serve import (user_id, node_of, nodes_of, user_keys, Chain, chain_of,
    chains_of, longest_valid_prefix, KVStore, Lease, TIERS, Events, Candidates, KVState, empty_state,
    prefill, extend, score, full_scores, PrefixCheck, check_prefix_stable, training_encoder, CACHEABLE, Trace,
    TraceRequest, read_trace, replay)

Modules, in the order a request flows through them:

- ``routing``: a user id's one form (an int or a string), and the serving node of a user,
  a jump consistent hash of its id (adding a node moves only the users it takes);
- ``chain``: the chain of a user's events (content hashes rolled, one checkpoint per page
  of P events, with the model version; Spark computes the same natively) and the longest
  prefix a held state and the current events both verify;
- ``store``: the users' paged states in device, host and disk tiers, bounded in bytes,
  LRU by user, leased users pinned, every lookup cut to its valid prefix, thread-safe;
- ``incremental``: a :class:`~userwise.pipelines.train.ReferenceRanker`'s causal
  encoder run incrementally (prefill, extend by new events, score candidates by their
  target attention over the cached keys and values), equal to the training forward over
  the whole held sequence; the prefix-stability check that says which encoders may be
  cached;
- ``trace``: a build's requests as a serving trace (:class:`Trace`: per serving node, in
  time order), read from a shard set through the loader's verified reader;
- ``build_replay``: the replay (``userwise replay``): a trace's requests served through
  the cache and through a full recompute, with a seeded model or a checkpoint's
  (:class:`~userwise.pipelines.train.Checkpoint`), its sizes and the disk tier's folder
  bounded; each user's events held in arrival order (as stored), by action time, or both
  side by side (``order=``: what late events cost a store sorted by action time);
- ``replay_report``: the replay's report, from each node's ``KVStore.stats()`` and the
  replay's tallies: logits equal, full and partial reuse and hits per tier, tokens
  recomputed, resident bytes, requests per second.

Torch and numpy (and pyarrow, where the replay reads a shard set); never imports pyspark.
"""

from userwise.pipelines.serve.build_replay import replay
from userwise.pipelines.serve.chain import Chain, chain_of, chains_of, longest_valid_prefix
from userwise.pipelines.serve.incremental import (
    CACHEABLE,
    Candidates,
    Events,
    KVState,
    PrefixCheck,
    check_prefix_stable,
    empty_state,
    extend,
    full_scores,
    prefill,
    score,
    training_encoder,
)
from userwise.pipelines.serve.routing import node_of, nodes_of, user_id, user_keys
from userwise.pipelines.serve.store import TIERS, KVStore, Lease
from userwise.pipelines.serve.trace import Trace, TraceRequest, read_trace

__all__ = [
    "user_id", "node_of", "nodes_of", "user_keys", "Chain", "chain_of", "chains_of", "longest_valid_prefix",
    "KVStore", "Lease", "TIERS", "Events", "Candidates", "KVState", "empty_state", "prefill", "extend", "score",
    "full_scores", "PrefixCheck", "check_prefix_stable", "training_encoder", "CACHEABLE", "Trace", "TraceRequest",
    "read_trace", "replay",
]
