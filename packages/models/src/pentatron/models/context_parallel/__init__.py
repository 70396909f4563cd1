"""Context parallelism: load-balanced sequence sharding and causal attention over the cp
group by a K/V ring ("p2p"), an all-gather of K/V ("all_gather") or all-to-all head
sharding ("a2a", Ulysses), or both in two levels ("a2a+p2p")."""

from .a2a import a2a_attention
from .all_gather import all_gather_attention
from .attention import context_parallel_attention
from .hierarchical import a2a_p2p_attention
from .ring import RingAttention, ring_attention
from .sharding import (
    CP_BATCH_KEYS,
    check_cp_seq_len,
    cp_positions,
    gather_cp_shards,
    get_batch_on_this_cp_rank,
    shard_for_cp_rank,
)
from .softmax_merge import block_backward, block_forward, merge

__all__ = [
    "CP_BATCH_KEYS",
    "RingAttention",
    "a2a_attention",
    "a2a_p2p_attention",
    "all_gather_attention",
    "block_backward",
    "block_forward",
    "check_cp_seq_len",
    "context_parallel_attention",
    "cp_positions",
    "gather_cp_shards",
    "get_batch_on_this_cp_rank",
    "merge",
    "ring_attention",
    "shard_for_cp_rank",
]
