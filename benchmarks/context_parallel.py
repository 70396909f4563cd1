"""Activation memory of the attention block per rank under context parallelism.

    python benchmarks/context_parallel.py

For cp in {1, 2, 4} and each cp_comm_type, one SelfAttention (fused QKV, RoPE, causal core
attention, output projection; GQA) runs forward on this rank's s/cp tokens while a
`torch.autograd.graph.saved_tensors_hooks` pair sums the bytes of every distinct tensor
autograd saves for backward, except the layer's own parameters (the weights a linear saves
are not activations, and they do not shrink with cp). The ratio cp=1 / cp should be about cp: every saved tensor is
`[s/cp, ...]` (all_gather keeps only the local K/V and gathers them again in backward).
Counts, not seconds: the result is the same on any machine.

This module imports nothing from benchmarks/ so the harness can load it by file path.
"""

from __future__ import annotations

from typing import Any

import torch

S, B, HEADS, GROUPS, D = 512, 1, 8, 4, 16
KINDS = ("p2p", "all_gather", "a2a")


def _saved_bytes(fn, params) -> int:
    seen: dict[tuple, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in weights:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()  # prove the graph is complete
    return sum(seen.values())


def attention_rank(cp: int, kind: str, seq: int = S) -> int:
    """Saved-activation bytes of one SelfAttention forward on this cp rank."""
    from pentatron.models import TransformerConfig, get_gpt_layer_local_spec
    from pentatron.models.context_parallel import cp_positions
    from pentatron.models.rope import RotaryEmbedding
    from pentatron.models.spec import build_module
    from pentatron.parallel_state import (
        ParallelConfig,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    torch.manual_seed(0)
    grid = initialize_model_parallel(ParallelConfig(cp=cp))
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HEADS * D,
            num_attention_heads=HEADS,
            num_query_groups=GROUPS,
            context_parallel_size=cp,
            cp_comm_type=kind,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        spec = get_gpt_layer_local_spec().submodules.self_attention
        attn = build_module(spec, config, layer_number=1)
        attn.core_attention.set_cp_group(grid.group("cp"))
        pos = cp_positions(seq, cp, grid.rank("cp"))[None]
        rotary = RotaryEmbedding(config)(pos, seq // cp)
        x = torch.randn(seq // cp, B, HEADS * D, requires_grad=True)
        return _saved_bytes(lambda: attn(x, None, rotary)[0], attn.parameters())
    finally:
        destroy_model_parallel(grid)


def measure(pools: Any, seq: int = S) -> list[dict[str, Any]]:
    rows = []
    for kind in KINDS:
        base = pools.run(1, attention_rank, 1, kind, seq)[0]
        for cp in (2, 4):
            per_rank = pools.run(cp, attention_rank, cp, kind, seq)
            rows.append({"kind": kind, "cp": cp, "cp1": base, "max_rank": max(per_rank)})
    return rows


def main() -> None:
    from pentatron.parallel_state.testing import PoolSet

    pools = PoolSet()
    try:
        rows = measure(pools)
    finally:
        pools.close()
    print(f"attention block, s={S}, b={B}, heads={HEADS}, groups={GROUPS}, d={D}, fp32")
    for r in rows:
        ratio = r["cp1"] / r["max_rank"]
        print(
            f"{r['kind']:>10} cp={r['cp']}: {r['cp1']:>10} B at cp=1 / {r['max_rank']:>10} B "
            f"per rank = {ratio:.2f} (ideal {r['cp']})"
        )


if __name__ == "__main__":
    main()
