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

Checkpoints: :meth:`ReferenceRanker.save` writes a torch file ``{"config": the constructor's
keyword arguments, "state_dict": the weights}`` (with a ``version`` and whatever else a
training loop keeps: its optimizer, its loaders' positions, its step);
:meth:`Checkpoint.read` reads one back, checked before any model is built (plain tensors
and values only, a config no bigger than its weights), and :meth:`Checkpoint.model` (or
:meth:`ReferenceRanker.load`) builds the model. The training loop (docs/training.md) and
``userwise replay --checkpoint`` read and write the same files.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import secrets
from dataclasses import dataclass

import torch
from torch import nn

from userwise.pipelines.errors import ArgumentError, UserwiseError, expect
from userwise.pipelines.train.attention import IMPLEMENTATIONS, attend
from userwise.pipelines.train.inputs import Fields, PointwiseBatch, UserBatch
from userwise.pipelines.train.masks import Intervals, causal_over, request_sequences, target_intervals

__all__ = ["ReferenceRanker", "Checkpoint", "CausalBlock", "ENCODERS"]

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
    :class:`~userwise.pipelines.errors.ArgumentError`.

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
            raise ArgumentError(f"encoder={encoder!r}: use one of {ENCODERS}")
        if encoder == "window" and (window is None or int(window) < 1):
            raise ArgumentError("encoder='window' needs window=W (events, >= 1), e.g. the build's max_seq_len")
        if attention not in IMPLEMENTATIONS:
            raise ArgumentError(f"attention={attention!r}: use one of {IMPLEMENTATIONS}")
        if dim % heads:
            raise ArgumentError(f"dim={dim} is not a multiple of heads={heads}")
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
            raise ArgumentError(f"ReferenceRanker.for_batch takes {', '.join(given)} from the batch; pass fields= "
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
            raise ArgumentError(f"ReferenceRanker.for_roles takes {', '.join(given)} from the roles; pass fields= "
                                "to name the columns, or build ReferenceRanker(...) yourself")
        fields = fields or Fields.from_roles(roles or {})
        return cls(side_features=len(fields.side), num_labels=len(fields.labels), **kw)

    # -- checkpoints -------------------------------------------------------------
    def config(self) -> dict:
        """The keyword arguments that build this model again (a checkpoint's ``config``).

        Example::

            twin = ReferenceRanker(**model.config())
        """
        return dict(dim=self.dim, heads=self.heads, layers=self.num_layers, side_features=len(self.side),
                    item_buckets=self.item_buckets, side_buckets=self.side_buckets,
                    action_buckets=self.action_buckets, num_labels=self.head[-1].out_features, encoder=self.encoder,
                    window=self.window, attention=self.attention, block=self.block)

    def save(self, path, *, version: str | None = None, **extra) -> None:
        """Write a checkpoint to ``path``: ``{"config": self.config(), "state_dict": its weights}``,
        with ``version`` (a serving cache's states belong to one model version; default: the
        file's sha256 names it when read) and ``extra`` (plain values and tensors, e.g. an
        optimizer's ``state_dict()``, loader states, a step), read back by
        :meth:`Checkpoint.read`. Written to a temporary file beside ``path``, then moved in
        place: a reader never sees half a checkpoint.

        Example::

            model.save(f"ckpt/step-{step:08d}.pt", opt=opt.state_dict(), step=step)
        """
        taken = sorted(set(extra) & {"config", "state_dict", "version"})
        if taken:
            raise ArgumentError(f"save(..., {', '.join(taken)}=...): the checkpoint writes those keys itself; "
                                "give the extra values other names")
        ck = {"config": self.config(), "state_dict": self.state_dict(),
              **({"version": str(version)} if version is not None else {}), **extra}
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"  # created new (O_EXCL), with the umask's mode
        f = open(tmp, "xb")
        try:
            with f:
                torch.save(ck, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path) -> "ReferenceRanker":
        """The model a checkpoint holds (:meth:`Checkpoint.read`, then :meth:`Checkpoint.model`), on the CPU.

        Example::

            model = ReferenceRanker.load("ckpt/step-00001000.pt").to(device).eval()
        """
        return Checkpoint.read(path).model()

    @staticmethod
    def sizes_of(config: dict, where: str = "") -> dict:
        """The sizes a model of keyword arguments ``config`` is built with (the constructor's
        defaults where ``config`` has none): ``dim``, ``heads``, ``layers``, ``side_features``,
        ``num_labels`` and the buckets, each checked to be an integer (else a
        :class:`~userwise.pipelines.errors.UserwiseError` naming ``where`` and the key).

        Example::

            ReferenceRanker.sizes_of({"dim": 64})["heads"]   # 2, the default
        """
        defaults = {k: v.default for k, v in inspect.signature(ReferenceRanker.__init__).parameters.items()
                    if v.default is not inspect.Parameter.empty}
        out = {}
        for k in ("dim", "heads", "layers", "side_features", "num_labels", "item_buckets", "side_buckets",
                  "action_buckets"):
            kind = "int>=1" if k in ("dim", "heads", "item_buckets", "side_buckets", "action_buckets") else "int>=0"
            out[k] = expect(config.get(k, defaults[k]), kind, f"{where}{k}", error=UserwiseError)
        return out

    @staticmethod
    def min_parameters(sizes: dict, encoder: str = "sample") -> int:
        """A lower bound of the parameters of a model of ``sizes`` (:meth:`sizes_of`): its
        embeddings, blocks, target projections and head (Python integers: never overflows), so
        a size can be refused before the model is built.

        Example::

            ReferenceRanker.min_parameters(ReferenceRanker.sizes_of({"dim": 64, "layers": 4}))
        """
        d = sizes["dim"]
        blocks = sizes["layers"] if encoder != "none" else 0
        emb = (sizes["item_buckets"] + sizes["side_features"] * sizes["side_buckets"] + sizes["action_buckets"]) * d
        return emb + blocks * (12 * d * d + 13 * d) + 3 * (d * d + d) + 2 * d * d + d + (d + 1) * sizes["num_labels"]

    @property
    def reach(self) -> int:
        """How many events before an event its ``"window"`` encoding can depend on."""
        return self.num_layers * (self.window - 1) if self.encoder == "window" else 0

    # -- parts -------------------------------------------------------------------
    def _ids(self, item, side):
        x = self.item(torch.remainder(item, self.item_buckets))
        if side.shape[1] != len(self.side):
            raise ArgumentError(f"the batch has {side.shape[1]} side-info features, the model {len(self.side)}; "
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
            raise ArgumentError(f"the batch has {labels.shape[-1]} labels, the model {logits.shape[-1]} logits per "
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


@dataclass(frozen=True)
class Checkpoint:
    """A :class:`ReferenceRanker` checkpoint as read from its file, before any model is built:
    ``path``; ``config`` (the constructor's keyword arguments); ``state_dict`` (the weights, on
    the CPU); ``version`` (the file's ``version``, else ``"sha256:"`` and the first 16 hex
    digits of the file's sha256); ``extra`` (whatever else :meth:`ReferenceRanker.save` was
    given); ``sizes`` (:meth:`ReferenceRanker.sizes_of` the config) and ``parameters`` (at
    least this many: :meth:`ReferenceRanker.min_parameters`).

    :meth:`read` refuses, each with one :class:`~userwise.pipelines.errors.UserwiseError`
    line naming the file: a missing file, anything but plain tensors and values (read with
    ``weights_only``), a file without ``config`` and ``state_dict``, a size that is not an
    integer, and a config that makes a model of more parameters than its weights hold (a
    damaged config is refused before minutes of building). :meth:`model` builds the model.

    Example::

        model.save("ck.pt", opt=opt.state_dict(), step=100)
        ck = Checkpoint.read("ck.pt")
        model, step = ck.model(), ck.extra["step"]      # model on the CPU
    """

    path: str
    config: dict
    state_dict: dict
    version: str
    extra: dict
    sizes: dict
    parameters: int

    @classmethod
    def read(cls, path) -> "Checkpoint":
        """Read and check the checkpoint at ``path`` (see the class doc).

        Example::

            ck = Checkpoint.read("ckpt/step-00001000.pt")
        """
        path = os.fspath(path)
        try:
            ck = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserwiseError(f"{path}: no such checkpoint") from None
        except Exception as e:  # noqa: BLE001 (any unreadable file is the user's to fix)
            raise UserwiseError(f"{path}: not a torch checkpoint of plain tensors and values "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        key = ("state_dict" if "state_dict" in ck else "model") if isinstance(ck, dict) else None
        sd = ck.get(key) if key else None
        cfg = ck.get("config") if isinstance(ck, dict) else None
        if not isinstance(cfg, dict) or not isinstance(sd, dict):
            raise UserwiseError(f"{path}: a ReferenceRanker checkpoint holds {{'config': its keyword arguments, "
                                "'state_dict': its weights}} (ReferenceRanker.save writes one)")
        # its config is bounded by its weights (a model of more parameters than the file holds
        # cannot load them), before the model is built
        sizes = ReferenceRanker.sizes_of(cfg, f"{path}: config ")
        held = sum(v.numel() for v in sd.values() if isinstance(v, torch.Tensor))
        params = ReferenceRanker.min_parameters(sizes, cfg.get("encoder", "sample"))
        if params > held:
            raise UserwiseError(f"{path}: its config makes a model of at least {params:,} parameters, its weights "
                                f"hold {held:,}: a config of another model")
        version = ck.get("version")
        if not version:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            version = "sha256:" + digest.hexdigest()[:16]
        extra = {k: v for k, v in ck.items() if k not in ("config", key, "version")}
        return cls(path=path, config=cfg, state_dict=sd, version=str(version), extra=extra, sizes=sizes,
                   parameters=params)

    def model(self) -> ReferenceRanker:
        """The :class:`ReferenceRanker` of this checkpoint's config with its weights, on the CPU.

        Example::

            model = Checkpoint.read("ck.pt").model().to(device)
        """
        try:
            model = ReferenceRanker(**self.config)
            model.load_state_dict(self.state_dict)
        except (TypeError, RuntimeError) as e:
            raise UserwiseError(f"{self.path}: its config and weights do not make a ReferenceRanker "
                                f"({' '.join(str(e).split())[:300]})") from None
        return model
