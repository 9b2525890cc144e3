"""KV events from vLLM: decoding, the tier-aware block index, and the ZMQ subscriber."""

from epp.kvevents.decoding import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    KVEventDecodeError,
    Tier,
    Topic,
    decode_batch,
    parse_topic,
    tier_for_medium,
)
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.keys import BlockKeyer
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics

__all__ = [
    "AllBlocksCleared", "BlockKeyer", "BlockRemoved", "BlockStored", "DecodedBatch", "KVBlockIndex",
    "KVEventDecodeError", "KVIndexMetrics", "KVSubscriberMetrics", "Tier", "Topic", "decode_batch",
    "parse_topic", "tier_for_medium",
]
