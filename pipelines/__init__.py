"""userwise.pipelines: the library behind the `userwise` command.

- Spark side (needs the ``spark`` extra): ``build``, ``daily``, ``expand``,
  ``preshard``, ``synth``; Delta I/O only in ``delta_io``.
- Trainer side (no Spark, no JVM): ``loader``, ``stage``.

Nothing here imports pyspark at package import time.
"""

__version__ = "0.1.0"
