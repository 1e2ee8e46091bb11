"""`userwise diagnose`: the three-step bottleneck test on one node's shards.

1. batches generated on the device (the consumer's own ceiling),
2. the same batch held on the host and copied to the device every step,
3. batches read from the shards by the loader.

The consumer step is the same in all three (an embedding-bag lookup over the
sequence items and a reduction over the impressions), so the ratios show
where time goes; the last line names the bottleneck.
"""

from __future__ import annotations

import time

import torch

from userwise.pipelines import console
from userwise.pipelines.errors import UserwiseError
from userwise.pipelines.loader.assembly.batch import JaggedBatch
from userwise.pipelines.loader.dataset import UserwiseDataset
from userwise.pipelines.loader.loader import UserwiseLoader


def _consumer(device):
    emb = torch.nn.EmbeddingBag(1 << 16, 32, mode="sum").to(device)

    def step(b: JaggedBatch) -> torch.Tensor:
        items = b["seq_item"].long() % (1 << 16) if "seq_item" in b else b["seq.offsets"].long()
        offs = b["seq.offsets"][:-1].long()
        out = emb(items, offs).sum()
        if "imp.req" in b:
            out = out + b["imp.req"].float().sum() * 0
        return out

    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(staged: str, *, device=None, batch_size=64, batches=50, num_workers=0) -> dict:
    """Return the rates of the three steps on the node's staged copy ``staged`` and the
    bottleneck (a dict)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserwiseError("--device cuda but no CUDA device is available; use --device cpu")
    ds = UserwiseDataset(staged, batch_size=batch_size, world_size=1, rank=0, verify="size", device=device)
    step = _consumer(device)
    host = next(iter(UserwiseLoader(ds, device="cpu")), None)
    if host is None:
        raise UserwiseError(f"{staged}: the shards hold no samples; nothing to time")
    n = max(1, batches)

    def timed(get):
        step(get())  # warm-up
        _sync(device)
        t = time.perf_counter()
        samples = 0
        for _ in range(n):
            b = get()
            samples += b.num_samples
            step(b)
        _sync(device)
        return samples / (time.perf_counter() - t)

    on_dev = host.to(device)
    r1 = timed(lambda: JaggedBatch(on_dev.buffer.clone(), on_dev.spec, on_dev.meta))
    src = host.pin_memory() if device.type == "cuda" else host
    r2 = timed(lambda: JaggedBatch(src.buffer.to(device, non_blocking=True) if device.type == "cuda"
                                   else src.buffer.clone(), src.spec, src.meta))
    loader = UserwiseLoader(ds, num_workers=num_workers, device=device)
    it = iter(_cycle(loader))
    r3 = timed(lambda: next(it))
    if r3 < 0.8 * r2:
        where = "reading from shards (decode / disk): add workers, use larger row groups or faster storage"
    elif r2 < 0.8 * r1:
        where = "host-to-device copy: pinned memory and prefetch, fewer bytes per sample"
    else:
        where = "compute (the consumer step): the data path keeps up"
    return {"device": str(device), "data_path": ds.data_path, "device_samples_per_s": r1,
            "host_copy_samples_per_s": r2, "shards_samples_per_s": r3, "bottleneck": where,
            "wait_share": loader.stats.summary()["wait_share"]}


def _cycle(loader):
    while True:
        got = False
        for b in loader:
            got = True
            yield b
        if not got:
            raise UserwiseError("the shards hold no samples")


def cli(args) -> int:
    r = run(args.staged, device=args.device, batch_size=args.batch_size, batches=args.batches,
            num_workers=getattr(args, "workers", 0) or 0)
    console.emit(r, report_text)
    return 0


def report_text(r: dict) -> str:
    return "\n".join([
        f"device: {r['device']}  data path: {r['data_path']}",
        f"1. generated on the device : {r['device_samples_per_s']:12.0f} samples/s",
        f"2. host, copied each step  : {r['host_copy_samples_per_s']:12.0f} samples/s",
        f"3. read from shards        : {r['shards_samples_per_s']:12.0f} samples/s  (consumer waited {r['wait_share']:.0%})",
        f"bottleneck: {r['bottleneck']}"])
