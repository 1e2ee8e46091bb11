"""Jobs over a build folder and its shard sets together: above both steps of the data path.

- ``backfill``: the daily chain over a date range: the tables of every day in a fixed number
  of Spark jobs, then per day preshard (a function call) and publish.
- ``forget``: remove users from every table of a build folder and from its shard sets.
"""
