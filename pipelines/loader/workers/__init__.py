"""The loader's worker processes, and how batches reach the trainer from them.

Modules:

- ``ring``: a worker's ring of reused shared-memory batch buffers, and the messages on its
  pipes (``Work``, ``Ready``, ``Done``, ``Failed``).
- ``lifeline``: how a worker process ends with its trainer, however the trainer ends.
- ``pool``: the persistent worker processes (``worker_main``) and their ``WorkerPool``.
- ``pinned``: the pool of pinned host buffers, and page-locking workers' slots (CUDA).

Imports the loader's ``logs`` only: a worker runs the dataset it is handed.
"""
