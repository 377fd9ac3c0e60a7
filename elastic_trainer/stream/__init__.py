"""Sharded, streamed data that resumes exactly at any world size (docs/sampler.md, "Streaming mode").

A ``Task`` may give a ``ShardedSource`` as its ``dataset``: shards (files or fsspec URLs) that are
read front to back, never indexed and never held whole. The trainer then deals the epoch out as
contiguous ranges of samples instead of index lists, and keeps the position as small, global state
in the checkpoint and the live state.

Modules:

- ``order``: the epoch's order (seeded shard order, seeded block shuffle) and the sample ids; pure;
- ``position``: ``StreamSampler``, the position (epoch, offset, the remaining ranges) and which rank
  reads what, resharded at every world-size change; pure;
- ``readers``: ``ParquetReader`` (pyarrow, row groups streamed) and ``TokenFileReader`` (flat token files);
- ``source``: ``ShardedSource`` (shards, reader, transform, shuffle settings) and ``list_shards``;
- ``loader``: ``StreamBatches``, this rank's micro-batches through DataLoader workers, from the committed position.

Exports those names.
"""

from __future__ import annotations

from elastic_trainer.stream.loader import StreamBatches
from elastic_trainer.stream.order import EpochOrder
from elastic_trainer.stream.position import StreamSampler
from elastic_trainer.stream.readers import ParquetReader, ShardReader, TokenFileReader
from elastic_trainer.stream.source import ShardedSource, list_shards

__all__ = ["EpochOrder", "ParquetReader", "ShardReader", "ShardedSource", "StreamBatches", "StreamSampler",
           "TokenFileReader", "list_shards"]
