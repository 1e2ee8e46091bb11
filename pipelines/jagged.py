"""The small jagged-array helpers, written once: the loader, the trainer's side and serving share them
(a module below every part: it imports numpy and torch only).

A jagged layout is flat values plus offsets (``[S + 1]``, segment ``s`` is
``values[offsets[s]:offsets[s + 1]]``). The helpers here turn lengths into offsets
(:func:`offsets`), offsets into each element's segment and position in it
(:func:`segment_ids`, :func:`positions`), runs into the indexes they cover
(:func:`ranges`), a request's sample-relative pointer into flat event indexes
(:func:`request_spans`), and named arrays into one buffer at the loader's alignment
(:func:`pack`, :data:`ALIGN`: what :class:`~userwise.pipelines.loader.JaggedBatch`
holds). All are vectorised, without a Python loop over segments.

The torch helpers run on the tensors' own device; on CPU they run in numpy (torch's
intra-op threads make small ops tens of times slower on a busy host, and a loader must
not compete with its trainer), giving the same values. The numpy variants (``np_``)
sit beside them where host code needs plain arrays.

Example::

    off = offsets(torch.tensor([2, 0, 3]))       # tensor([0, 2, 2, 5])
    segment_ids(off)                             # tensor([0, 0, 2, 2, 2])
    ranges(torch.tensor([10, 4]), torch.tensor([2, 3]))  # tensor([10, 11, 4, 5, 6])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

__all__ = ["ALIGN", "align", "dtype_name", "ranges", "np_ranges", "offsets", "np_offsets", "segment_ids",
           "np_segment_ids", "positions", "np_positions", "repeat", "take", "request_spans", "np_request_spans",
           "pack"]

# Every array of a batch buffer starts at a multiple of ALIGN bytes (the loader's assemblers, pack).
ALIGN = 64


def align(n: int) -> int:
    """The first multiple of :data:`ALIGN` at or above ``n`` (bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(t: torch.dtype) -> str:
    """A torch dtype's name as a batch's spec records it (``torch.int64`` -> ``"int64"``)."""
    return str(t).removeprefix("torch.")


def _host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


# -- runs -------------------------------------------------------------------------------
def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated aranges ``[s, s + l)`` as one int64 index tensor on ``starts``' device."""
    if _host(starts):
        return torch.from_numpy(np_ranges(starts.numpy().astype(np.int64), lengths.numpy().astype(np.int64)))
    starts, lengths = starts.long(), lengths.long()
    total = int(lengths.sum().item()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    out_off = torch.cumsum(lengths, 0) - lengths
    rep = torch.repeat_interleave(starts - out_off, lengths, output_size=total)
    return rep + torch.arange(total, device=starts.device)


def np_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges ``[s, s + l)`` (numpy int64)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    out_off = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_off, lengths) + np.arange(total)


# -- offsets, segments, positions --------------------------------------------------------
def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets ``[S + 1]`` (int64, from 0) of segments of ``lengths`` ``[S]``."""
    if _host(lengths):
        return torch.from_numpy(np_offsets(lengths.numpy()))
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    torch.cumsum(lengths.long(), 0, out=out[1:])
    return out


def np_offsets(lengths: np.ndarray) -> np.ndarray:
    """Offsets ``[S + 1]`` (int64, from 0) of segments of ``lengths`` ``[S]``."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def segment_ids(offsets: torch.Tensor) -> torch.Tensor:
    """The segment of every element of offsets ``[S + 1]``: ``[0, 0, 1, 2, 2, ...]`` (int64)."""
    if _host(offsets):
        return torch.from_numpy(np_segment_ids(offsets.numpy()))
    offsets = offsets.long()
    total = int(offsets[-1]) if offsets.numel() else 0
    return torch.repeat_interleave(torch.arange(max(offsets.numel() - 1, 0), device=offsets.device),
                                   offsets[1:] - offsets[:-1], output_size=total)


def np_segment_ids(offsets: np.ndarray) -> np.ndarray:
    """The segment of every element of offsets ``[S + 1]`` (numpy int64)."""
    offsets = np.asarray(offsets, np.int64)
    return np.repeat(np.arange(max(len(offsets) - 1, 0), dtype=np.int64), np.diff(offsets))


def positions(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, position within it) of every element of offsets ``[S + 1]`` (int64)."""
    if _host(offsets):
        seg, pos = np_positions(offsets.numpy())
        return torch.from_numpy(seg), torch.from_numpy(pos)
    offsets = offsets.long()
    seg = segment_ids(offsets)
    return seg, torch.arange(seg.numel(), device=offsets.device) - offsets[:-1][seg]


def np_positions(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment, position within it) of every element of offsets ``[S + 1]`` (numpy int64)."""
    offsets = np.asarray(offsets, np.int64)
    seg = np_segment_ids(offsets)
    return seg, np.arange(len(seg), dtype=np.int64) - offsets[:-1][seg]


def repeat(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``repeat_interleave(values, counts)`` with its ``total`` length known."""
    if _host(values):
        return torch.from_numpy(np.repeat(values.numpy(), counts.numpy().astype(np.int64)))
    return torch.repeat_interleave(values, counts, output_size=total)


def take(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = src[idx]``."""
    if _host(src):
        np.take(src.numpy(), idx.numpy(), out=out.numpy())
    else:
        torch.index_select(src, 0, idx, out=out)


# -- the pointer ---------------------------------------------------------------------------
def request_spans(seq_offsets: torch.Tensor, req_sample: torch.Tensor, begin: torch.Tensor,
                  end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's span ``[begin, end)`` (sample-relative, as stored) in flat indexes of
    the batch's stored events: ``seq_offsets[req_sample] + begin`` (int64, on their device)."""
    base = seq_offsets.long()[:-1][req_sample.long()]
    return base + begin.long(), base + end.long()


def np_request_spans(seq_offsets: np.ndarray, req_sample: np.ndarray, begin: np.ndarray,
                     end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`request_spans` in numpy (int64)."""
    base = np.asarray(seq_offsets, np.int64)[:-1][req_sample]
    return base + np.asarray(begin, np.int64), base + np.asarray(end, np.int64)


# -- one buffer -----------------------------------------------------------------------------
def pack(arrays: Iterable[tuple[str, torch.dtype, int, Callable[[torch.Tensor], object]]],
         alloc: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """Named arrays in one uint8 buffer, in the order given, each at an :data:`ALIGN`-aligned
    byte offset, the padding zeroed (equal arrays give equal bytes). ``arrays``: ``(name,
    dtype, numel, fill)`` where ``fill(view)`` writes the array into its slot (a view of
    ``numel`` elements of ``dtype``); ``alloc(nbytes)`` gives the buffer (at least
    :data:`ALIGN` bytes). Returns the buffer and its spec, ``(name, dtype name, byte
    offset, numel)`` per array: a :class:`~userwise.pipelines.loader.JaggedBatch`'s."""
    items, spec, pos = list(arrays), [], 0
    for name, dtype, numel, _ in items:
        spec.append((name, dtype_name(dtype), pos, int(numel)))
        pos = align(pos + dtype.itemsize * int(numel))
    buf = alloc(max(pos, ALIGN))
    for (_, dtype, numel, fill), (_, _, off, _) in zip(items, spec):
        size = dtype.itemsize * int(numel)
        if numel:
            fill(buf[off: off + size].view(dtype))
        end = align(off + size)
        if end > off + size:
            buf[off + size: end].zero_()
    if buf.numel() > pos:
        buf[pos:].zero_()
    return buf, tuple(spec)
