"""Shared pieces of the checkpoint tests: a tiny GPT at any layout, its optimizer and
scheduler, seeded global batches and one training step (pipeline + DDP + optimizer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.models import (
    GPTModel,
    TransformerConfig,
    build_model_chunks,
    get_gpt_layer_local_spec,
    load_full_state_dict,
)
from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    OptimizerParamScheduler,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.parallel_state import ParallelConfig, ProcessGrid, comm, initialize_model_parallel
from pentatron.pipeline import PipelineConfig, get_forward_backward_func
from pentatron.tp_layers import model_parallel_seed

VOCAB, S, DIVISIBLE_BY = 128, 16, 32  # no vocabulary padding at tp in {1, 2, 4}
GLOBAL_BATCH = 8  # sequences per step, split over dp, micro-batches of one
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: another layout only reorders sums


def tiny_config(**overrides: Any) -> TransformerConfig:
    """4 layers, hidden 32, 8 heads in 4 query groups (GQA), SwiGLU, RoPE, RMSNorm, biases."""
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.1,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def full_state(config: TransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    """The single-process model's state (global names): every layout starts from it."""
    torch.manual_seed(seed)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), VOCAB, S, make_vocab_size_divisible_by=DIVISIBLE_BY
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Run:
    grid: ProcessGrid
    config: TransformerConfig
    chunks: list[DistributedDataParallel]
    optimizer: Any
    scheduler: OptimizerParamScheduler


def make_grid(tp: int, pp: int, vpp: int | None) -> ProcessGrid:
    grid = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
    model_parallel_seed(1234 + 100 * grid.rank("pp"), grid)
    return grid


def build_run(
    grid: ProcessGrid,
    state: dict | None,
    dist_opt: bool,
    bf16: bool = False,
    spec: Any = None,
    **overrides: Any,
) -> Run:
    """Model chunks at the grid's layout (from `state`), DDP, Adam, warm-up + cosine lr;
    `bf16`: bf16 params with fp32 main params; `spec`: the layer spec (default local)."""
    if bf16:
        overrides["params_dtype"] = torch.bfloat16
    config = dataclasses.replace(
        tiny_config(**overrides),
        tensor_model_parallel_size=grid.size("tp"),
        pipeline_model_parallel_size=grid.size("pp"),
        virtual_pipeline_model_parallel_size=grid.layout.vpp,
    )
    models = build_model_chunks(
        config,
        spec or get_gpt_layer_local_spec(),
        VOCAB,
        S,
        grid,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    for m in models:
        if state is not None:
            load_full_state_dict(m, state)
    ddp_cfg = DDPConfig(use_distributed_optimizer=dist_opt, bucket_size=2000)
    chunks = [DistributedDataParallel(ddp_cfg, m, grid=grid) for m in models]
    opt_cfg = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=dist_opt, bf16=bf16
    )
    optimizer = get_optimizer(opt_cfg, chunks, grid=grid)
    scheduler = OptimizerParamScheduler(
        optimizer, 0.0, 1e-2, 1e-3, 2, 10, "cosine", 0.1, 0.1, 10, "constant"
    )
    return Run(grid, config, chunks, optimizer, scheduler)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, S), generator=g)
    return ids, torch.randint(0, VOCAB, (GLOBAL_BATCH, S), generator=g)


def _loss(output: torch.Tensor):
    loss = output.mean()
    return loss, loss.detach()


def _forward_step(data_iterator, model):
    ids, pos, labels = next(data_iterator)
    return model(ids, pos, labels=labels), _loss


def train_step(run: Run, step: int) -> float | None:
    """One step on the global batch of `step`; its mean loss on one last-stage rank."""
    grid, config = run.grid, run.config
    ids, labels = global_batch(step)
    d, r = grid.size("dp"), grid.rank("dp")
    per = GLOBAL_BATCH // d
    pos = torch.arange(S).unsqueeze(0)
    data = [(ids[i : i + 1], pos, labels[i : i + 1]) for i in range(r * per, (r + 1) * per)]
    vpp = config.virtual_pipeline_model_parallel_size
    pcfg = PipelineConfig(
        hidden_size=config.hidden_size,
        finalize_model_grads_func=lambda chunks, tokens: finalize_model_grads(chunks, grid=grid),
    )
    run.optimizer.zero_grad()
    losses = get_forward_backward_func(config.pipeline_model_parallel_size, vpp)(
        forward_step_func=_forward_step,
        data_iterator=[iter(data) for _ in run.chunks] if vpp else iter(data),
        model=run.chunks if vpp else run.chunks[0],
        num_microbatches=len(data),
        seq_length=S,
        micro_batch_size=1,
        config=pcfg,
        grid=grid,
    )
    assert run.optimizer.step().update_successful
    run.scheduler.step(1)
    if not losses:
        return None
    mean = torch.stack(list(losses)).mean()
    comm.all_reduce(mean, group=grid.group("dp"))
    return (mean / d).item() if grid.rank("tp") == 0 and r == 0 else None


def one_loss(per_rank: list[Any]) -> Any:
    """The loss reported by the single rank that reports it."""
    found = [x for x in per_rank if x is not None]
    assert len(found) == 1, found
    return found[0]
