"""The one test config: the synthetic log's columns (``userwise synth``'s config) with
the tests' sizes. ``LEAN_CFG`` and ``fat_cfg()`` for unit tests, :func:`config` for
generators that need other sizes (the edge-case logs)."""

from userwise.pipelines.tools import synth


def config(max_seq_len: int = 20, *, max_sample_cost: int = 200, fat: bool = False, actions: bool = False,
           **over) -> dict:
    """A fresh config dict (lean, fat, or lean with ``columns.actions``); ``over`` sets top-level keys."""
    c = synth.make_config(max_seq_len, 0, fat=fat, actions=actions)
    del c["seed"]
    c["max_sample_cost"] = max_sample_cost
    c.update(over)
    return c


LEAN_CFG = config()


def fat_cfg() -> dict:
    return config(fat=True)
