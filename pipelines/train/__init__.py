"""The trainer's half of the pointer: from a ``JaggedBatch`` to attention that cannot leak.

Public names::

    from userwise.pipelines.train import (UserBatch, PointwiseBatch, Fields, ReferenceRanker, Checkpoint,
    Spans, spans, Intervals, target_intervals, causal_intervals, causal_over, request_sequences,
    dense_target_masks, dense_causal_masks, attend, KernelLayout, hstu_mha_layout,
    hstu_varlen_layout, hstu_mha_mask, hstu_varlen_mask, audit, stochastic_length, TableStats,
    lru_stack_distances, table_stats, table_stats_from_counts, read_id_stats, planner_constraints)

Modules, in the order data flows through them:

- ``batch_spans``: the batch-level pointer: per impression its sample, its request and its
  visible span ``[seq_begin, seq_end)`` in batch-level indices (:func:`spans`, :class:`Spans`);
- ``stochastic``: HSTU's stochastic length, a seeded read-time sub-sampling of long
  sequences that keeps every span consistent (:func:`stochastic_length`);
- ``masks``: the masks as one interval per query row (:class:`Intervals`): target
  attention, the causal encoder (optionally windowed), per-request sequences; as dense
  masks, a FlexAttention ``mask_mod`` and a ``BlockMask``;
- ``attention``: softmax attention under such a mask (:func:`attend`): pure-torch
  block-sparse (any device, forward and backward), FlexAttention, and a dense reference;
- ``kernel_args``: the kernels' argument layouts (:class:`KernelLayout`) for
  generative-recommenders' ``hstu_mha`` and NVIDIA's ``hstu_attn_varlen_func``, the masks
  those kernels apply, and an audit of them;
- ``inputs``: the model's inputs (:class:`UserBatch`, :class:`PointwiseBatch`,
  :class:`Fields`);
- ``planner_stats``: TorchRec's planner inputs from the data: per embedding table the distinct
  ids of a global batch and the exact LRU miss-ratio curve (:class:`TableStats`, in
  ``EmbeddingOffloadStats``' shape), from the ids in training order (:func:`table_stats`) or
  the build's ``id_stats`` (:func:`read_id_stats`, :func:`table_stats_from_counts`), handed to
  the planner as UVM-cache constraints (:func:`planner_constraints`; docs/embeddings.md);
- ``model``: the reference model (:class:`ReferenceRanker`): a user-wise and a
  point-wise forward, and their FLOPs; its checkpoints (``ReferenceRanker.save``,
  :class:`Checkpoint`: read, checked, built), which training and ``userwise replay`` share.

The jagged helpers (ranges, offsets, positions in segments) are the loader's
(:mod:`userwise.pipelines.jagged`). Torch only (the kernels are optional and never
imported); never imports pyspark. See docs/training.md.
"""

from userwise.pipelines.train.attention import attend
from userwise.pipelines.train.batch_spans import Spans, spans
from userwise.pipelines.train.inputs import Fields, PointwiseBatch, UserBatch
from userwise.pipelines.train.kernel_args import (
    KernelLayout,
    audit,
    hstu_mha_layout,
    hstu_mha_mask,
    hstu_varlen_layout,
    hstu_varlen_mask,
)
from userwise.pipelines.train.masks import (
    Intervals,
    causal_intervals,
    causal_over,
    dense_causal_masks,
    dense_target_masks,
    request_sequences,
    target_intervals,
)
from userwise.pipelines.train.model import Checkpoint, ReferenceRanker
from userwise.pipelines.train.planner_stats import (
    TableStats,
    lru_stack_distances,
    planner_constraints,
    read_id_stats,
    table_stats,
    table_stats_from_counts,
)
from userwise.pipelines.train.stochastic import stochastic_length

__all__ = [
    "UserBatch", "PointwiseBatch", "Fields", "ReferenceRanker", "Checkpoint", "Spans", "spans", "Intervals",
    "target_intervals", "causal_intervals", "causal_over", "request_sequences", "dense_target_masks",
    "dense_causal_masks", "attend", "KernelLayout", "hstu_mha_layout", "hstu_varlen_layout", "hstu_mha_mask",
    "hstu_varlen_mask", "audit", "stochastic_length", "TableStats", "lru_stack_distances", "table_stats",
    "table_stats_from_counts", "read_id_stats", "planner_constraints",
]
