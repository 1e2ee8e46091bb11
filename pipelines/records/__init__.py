"""The build folder's records: everything under ``D/_userwise/`` beside the Delta tables.

Below both steps of the data path: the builder writes them, the shard steps read them,
neither reaches into the other. No Spark here.

- ``folder``: the layout of ``D/_userwise/``, spelled once.
- ``build_record``: ``build.json``: the config, input schema and roles a folder was built from.
- ``writer_lock``: one writer per build folder (``locks/``), a lock a crash cannot wedge.
- ``state``: all or nothing: ``complete.json`` (the tables' versions of the last complete
  state, written last) and ``running.json`` (the job running, or the one that died).
- ``published``: ``published/<kind>/<date>.json``, the record of each published shard set.
"""
