"""The reference model: encode a user's sequence once, score every impression against it.

:class:`ReferenceRanker` is small on purpose (one file, a few modules):

- embeddings: an item table shared by events and targets, one table per side-info
  feature (also shared), one for the events' action bits; ids are hashed into the
  tables by ``id mod buckets``;
- a causal sequence encoder (``layers`` pre-norm transformer blocks) run **once per
  sample** over its stored events. ``encoder`` picks what an event's encoding may
  depend on (docs/training.md, "The causal encoder"):

  - ``"sample"``: every earlier stored event of its sample (one pass per sample);
  - ``"window"``: only the ``window`` newest events up to itself, per layer (one pass
    per sample; the receptive field is ``layers * (window - 1)`` events back);
  - ``"request"``: each request's span is encoded on its own (one pass per request:
    exactly what point-wise rows truncated at L compute; it saves the impressions
    factor only);
  - ``"none"``: the event embeddings themselves (target attention alone);

- target attention: each impression's target (item plus side-info) is the query over
  the encoded events of its request's span ``[seq_begin, seq_end)``;
- a head: an MLP over (target, attended history) giving one logit per label.

:meth:`ReferenceRanker.for_batch` sizes the model from a batch (its side-info features and
labels, from the build's roles) and puts it on the batch's device.
:meth:`ReferenceRanker.forward` takes a :class:`UserBatch`;
:meth:`ReferenceRanker.forward_pointwise` the same model one impression at a time over
point-wise rows (:class:`PointwiseBatch`: each row its own sequence, its target over
the row's history). Neither loops over samples or impressions in Python.
"""

from __future__ import annotations

import torch
from torch import nn

from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.train.attention import IMPLEMENTATIONS, attend
from userwise.pipelines.train.inputs import Fields, PointwiseBatch, UserBatch
from userwise.pipelines.train.masks import Intervals, causal_over, request_sequences, target_intervals

__all__ = ["ReferenceRanker", "CausalBlock", "ENCODERS"]

ENCODERS = ("sample", "window", "request", "none")


class CausalBlock(nn.Module):
    """Pre-norm transformer block whose attention follows an :class:`Intervals` mask."""

    def __init__(self, dim: int, heads: int, mlp: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp * dim), nn.GELU(), nn.Linear(mlp * dim, dim))

    def forward(self, x: torch.Tensor, iv: Intervals, impl: str, block: int) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, d // self.heads).unbind(1)
        x = x + self.out(attend(q, k, v, iv, impl, block=block).reshape(n, d))
        return x + self.mlp(self.norm2(x))


class ReferenceRanker(nn.Module):
    """Args (keyword-only): ``dim`` (32), ``heads`` (2), ``layers`` (1: encoder blocks),
    ``side_features`` (side-info features per event and target), ``num_labels`` (logits per
    impression), ``item_buckets`` (2**14), ``side_buckets`` (1024), ``action_buckets`` (16),
    ``encoder`` ("sample", see module doc), ``window`` (events, for ``encoder="window"``),
    ``attention`` ("blocks" | "flex" | "dense"), ``block`` (64: attention block size).

    :meth:`for_batch` takes ``side_features`` and ``num_labels`` from a batch (the build's
    roles) and returns the model on the batch's device; built directly, they default to the
    synthetic log's 2 and 2, and a batch of other roles is refused with a
    :class:`~userwise.pipelines.errors.UserwiseError`.

    Example::

        batch = next(iter(loader))                     # on the loader's device
        model = ReferenceRanker.for_batch(batch, dim=32, encoder="sample")
        ub = UserBatch.from_jagged(batch)
        loss = model.loss(model(ub), ub.labels)
    """

    def __init__(self, *, dim: int = 32, heads: int = 2, layers: int = 1, side_features: int = 2,
                 item_buckets: int = 1 << 14, side_buckets: int = 1024, action_buckets: int = 16, num_labels: int = 2,
                 encoder: str = "sample", window: int | None = None, attention: str = "blocks", block: int = 64):
        super().__init__()
        if encoder not in ENCODERS:
            raise UserwiseError(f"encoder={encoder!r}: use one of {ENCODERS}")
        if encoder == "window" and (window is None or int(window) < 1):
            raise UserwiseError("encoder='window' needs window=W (events, >= 1), e.g. the build's max_seq_len")
        if attention not in IMPLEMENTATIONS:
            raise UserwiseError(f"attention={attention!r}: use one of {IMPLEMENTATIONS}")
        if dim % heads:
            raise UserwiseError(f"dim={dim} is not a multiple of heads={heads}")
        self.dim, self.heads, self.num_layers = dim, heads, layers
        self.encoder = encoder
        self.window = int(window) if encoder == "window" else None  # only the window encoder has one
        self.attention, self.block = attention, block
        self.item_buckets, self.side_buckets, self.action_buckets = item_buckets, side_buckets, action_buckets
        self.item = nn.Embedding(item_buckets, dim)
        self.side = nn.ModuleList(nn.Embedding(side_buckets, dim) for _ in range(side_features))
        self.action = nn.Embedding(action_buckets, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads) for _ in range(layers if encoder != "none" else 0))
        self.tq, self.tk, self.tv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.GELU(), nn.Linear(dim, num_labels))
        for e in [self.item, self.action, *self.side]:
            nn.init.normal_(e.weight, std=0.1)

    @classmethod
    def for_batch(cls, batch, *, fields: Fields | None = None, **kw) -> "ReferenceRanker":
        """A model sized for ``batch``, on its device: ``side_features`` and ``num_labels`` from
        its columns as ``fields`` names them (default :meth:`Fields.from_roles` of the batch's
        ``meta["roles"]``, as :meth:`UserBatch.from_jagged` reads them). ``batch``: a
        :class:`~userwise.pipelines.loader.JaggedBatch` or a :class:`UserBatch`; ``kw``: the
        constructor's other arguments (``dim``, ``encoder`` ...).

        Example::

            model = ReferenceRanker.for_batch(first_batch, dim=32)   # any build's roles, its device
        """
        given = sorted(set(kw) & {"side_features", "num_labels"})
        if given:
            raise UserwiseError(f"ReferenceRanker.for_batch takes {', '.join(given)} from the batch; pass fields= "
                                "to name its columns, or build ReferenceRanker(...) yourself")
        if isinstance(batch, UserBatch):
            side, labels, device = batch.ev_side.shape[1], batch.labels.shape[1], batch.ev_item.device
        else:
            if fields is None:
                meta = getattr(batch, "meta", None)
                fields = Fields.from_roles((meta or {}).get("roles") or {})
            side, labels, device = len(fields.side), len(fields.labels), batch.device
        return cls(side_features=side, num_labels=labels, **kw).to(device)

    @classmethod
    def for_roles(cls, roles: dict, *, fields: Fields | None = None, **kw) -> "ReferenceRanker":
        """A model sized for a build's column roles (``UserwiseDataset.roles``, or a batch's
        ``meta["roles"]``): ``side_features`` and ``num_labels`` from them, as
        :meth:`for_batch` takes them; on the CPU (move it with ``.to(device)``). For a model
        that must exist before the first batch, as DDP's does.

        Example::

            model = ReferenceRanker.for_roles(dataset.roles, dim=32).to(device)
        """
        given = sorted(set(kw) & {"side_features", "num_labels"})
        if given:
            raise UserwiseError(f"ReferenceRanker.for_roles takes {', '.join(given)} from the roles; pass fields= "
                                "to name the columns, or build ReferenceRanker(...) yourself")
        fields = fields or Fields.from_roles(roles or {})
        return cls(side_features=len(fields.side), num_labels=len(fields.labels), **kw)

    @property
    def reach(self) -> int:
        """How many events before an event its ``"window"`` encoding can depend on."""
        return self.num_layers * (self.window - 1) if self.encoder == "window" else 0

    # -- parts -------------------------------------------------------------------
    def _ids(self, item, side):
        x = self.item(torch.remainder(item, self.item_buckets))
        if side.shape[1] != len(self.side):
            raise UserwiseError(f"the batch has {side.shape[1]} side-info features, the model {len(self.side)}; "
                                "build the model with ReferenceRanker.for_batch(batch) (or side_features=)")
        for i, emb in enumerate(self.side):
            x = x + emb(torch.remainder(side[:, i], self.side_buckets))
        return x

    def embed_events(self, item, side, action) -> torch.Tensor:
        return self._ids(item, side) + self.action(torch.remainder(action, self.action_buckets))

    def embed_targets(self, item, side) -> torch.Tensor:
        return self._ids(item, side)

    def encode(self, x: torch.Tensor, offsets: torch.Tensor, window: int | None) -> torch.Tensor:
        """The causal encoder over the segments of ``offsets`` (each a sequence)."""
        iv = causal_over(offsets, window)
        for blk in self.blocks:
            x = blk(x, iv, self.attention, self.block)
        return x

    def score(self, t: torch.Tensor, enc: torch.Tensor, iv: Intervals) -> torch.Tensor:
        """Target attention (``t`` the queries over ``enc`` under ``iv``) and the head."""
        n, d = t.shape
        h = self.heads
        q = self.tq(t).view(n, h, d // h)
        k, v = self.tk(enc).view(-1, h, d // h), self.tv(enc).view(-1, h, d // h)
        a = attend(q, k, v, iv, self.attention, block=self.block).reshape(n, d)
        return self.head(torch.cat([t, a], 1))

    # -- forwards ------------------------------------------------------------------
    def forward(self, ub: UserBatch) -> torch.Tensor:
        """User-wise: logits [N, num_labels], one row per impression in batch order."""
        sp = ub.spans
        x = self.embed_events(ub.ev_item, ub.ev_side, ub.ev_action)
        if self.encoder == "request":
            rs = request_sequences(sp)
            enc = self.encode(x[rs.event], rs.offsets, None)
            iv = Intervals(rs.offsets[:-1][sp.imp_req], rs.offsets[1:][sp.imp_req], rs.event.numel())
        else:
            enc = x if self.encoder == "none" else self.encode(x, sp.seq_offsets, self.window)
            iv = target_intervals(sp)
        return self.score(self.embed_targets(ub.tgt_item, ub.tgt_side), enc, iv)

    def forward_pointwise(self, pb: PointwiseBatch) -> torch.Tensor:
        """Point-wise: each row is its own sequence; the encoder runs over the row's history
        (causal; ``"window"`` keeps its window) and the target attends to the history from
        ``visible_from`` on. Logits [N, num_labels]."""
        x = self.embed_events(pb.hist_item, pb.hist_side, pb.hist_action)
        off = pb.hist_offsets
        enc = x if self.encoder == "none" else self.encode(x, off, self.window)
        iv = Intervals(off[:-1] + pb.visible_from, off[1:], x.shape[0])
        return self.score(self.embed_targets(pb.tgt_item, pb.tgt_side), enc, iv)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean binary cross-entropy over impressions and labels (0 with the graph kept for an
        empty batch, so every rank of a DDP job still runs its backward)."""
        if logits.shape[-1] != labels.shape[-1]:
            raise UserwiseError(f"the batch has {labels.shape[-1]} labels, the model {logits.shape[-1]} logits per "
                                "impression; build the model with ReferenceRanker.for_batch(batch) (or num_labels=)")
        if logits.numel() == 0:
            return logits.sum() * 0.0
        return nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

    # -- cost ----------------------------------------------------------------------
    def flops(self, batch) -> dict:
        """Forward FLOPs (a multiply-add is 2) of :meth:`forward` (a :class:`UserBatch`) or
        :meth:`forward_pointwise` (a :class:`PointwiseBatch`), counting exactly the visible
        attention pairs. Keys: ``encoder``, ``encoder_attention``, ``target_attention``
        (the least plan: the target attention's pairs alone), ``other``, ``total``,
        ``impressions``. Training costs about 3x these."""
        d, L = self.dim, self.num_layers if self.encoder != "none" else 0
        if isinstance(batch, UserBatch):
            sp = batch.spans
            if self.encoder == "request":
                rs = request_sequences(sp)
                tokens, enc_iv = rs.event.numel(), causal_over(rs.offsets, None)
                tgt_pairs = int((sp.imp_end - sp.imp_begin).sum())
            else:
                tokens, enc_iv = sp.num_events, causal_over(sp.seq_offsets, self.window)
                tgt_pairs = target_intervals(sp).pairs()
            n = sp.num_impressions
        else:
            off = batch.hist_offsets
            tokens, enc_iv = int(off[-1]), causal_over(off, self.window)
            tgt_pairs = int((off[1:] - off[:-1] - batch.visible_from).sum())
            n = batch.num_impressions
        enc_lin = L * tokens * 24 * d * d
        enc_att = L * enc_iv.pairs() * 4 * d
        tgt_att = tgt_pairs * 4 * d
        other = tokens * 4 * d * d + n * (2 * d * d + 4 * d * d + 2 * d * self.head[-1].out_features)
        total = enc_lin + enc_att + tgt_att + other
        return {"encoder": enc_lin + enc_att, "encoder_attention": enc_att, "target_attention": tgt_att,
                "other": other, "total": total, "impressions": n}
