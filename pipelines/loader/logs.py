"""The loader's log: the ``userwise.loader`` logger and its once-per-process notices.

A dataset says once per process which data path it reads by (:mod:`gpudirect`), the
copy kernels which implementation runs (:mod:`segcopy`), the workers when they fall
back to copying batches out of their ring (:mod:`workers`).

Example::

    say_once("userwise loader: data path = parquet: ...")   # logged the first time only
"""

from __future__ import annotations

import logging

__all__ = ["log", "say_once"]

log = logging.getLogger("userwise.loader")
_SAID: set[str] = set()


def say_once(msg: str) -> None:
    """Log ``msg`` (a warning) the first time this process says it."""
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning(msg)
