"""Streamed training: producers run the target and write the cache's own records into a bounded spool, trainers read
them with the cache's reader views, so a run needs no cache the size of its data (deepspec/data/stream/spool.py).

Built on top of the cache (deepspec/data/cache/: its plan, featurizer and record format); the cache never imports
from here.
"""
