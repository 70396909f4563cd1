"""`pretrain_gpt`: Megatron's entry point, with its four replaceable callbacks.

    torchrun --nproc-per-node 8 -m pentatron.pretrain --tensor-model-parallel-size 2 ...

`model_provider(pre_process, post_process, vp_stage)` builds one GPT chunk,
`datasets_provider(train_valid_test_num_samples)` the datasets, `forward_step` (in
`gpt_step`) runs a micro-batch, and `pretrain(...)` wires them with the packages. With no
data flags the embedded corpus (this Python's standard library sources, BPE-tokenized and
cached on first use) is the training data.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from pentatron.models import GPTModel, get_gpt_layer_local_spec, get_gpt_layer_te_spec
from pentatron.parallel_state import gloo_threads, shutdown

from .arguments import ArgumentError, parse_args, validate_args
from .gpt_step import make_forward_step
from .training import configs
from .training.loop import NonFiniteLossError, Trainer, TrainState
from .training.setup import (
    build_iterators,
    initialize,
    setup_model_and_optimizer,
)
from .training.step import make_pipeline_config


def resolve_data(args: argparse.Namespace, grid) -> None:
    """Fill --data-path / --tokenizer-* from the embedded corpus when no data was given
    (built by one rank while the others wait on the host group)."""
    if args.mock_data or args.data_path:
        return
    from .data import prepare_embedded_corpus

    corpus = prepare_embedded_corpus(cache_dir=args.data_cache_path, group=grid.host_group)
    args.data_path = [corpus.data_prefix]
    args.tokenizer_type = args.tokenizer_type or "PentatronBPETokenizer"
    args.tokenizer_model = args.tokenizer_model or corpus.tokenizer_dir


def build_tokenizer_for(args: argparse.Namespace):
    from .tokenizer.arguments import tokenizer_from_args

    if args.mock_data and args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer"
        args.vocab_size = args.vocab_size or 4096
    return tokenizer_from_args(args, cache_dir=args.data_cache_path)


def model_provider(
    args, grid, vocab_size: int, pre_process: bool, post_process: bool, vp_stage: int | None = None
) -> GPTModel:
    te = args.transformer_impl == "transformer_engine"
    if te:  # validation sends MLA to the local spec
        spec = get_gpt_layer_te_spec(args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.qk_layernorm, args.multi_latent_attention)
    return GPTModel(
        configs.transformer_config(args),
        spec,
        vocab_size,
        args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        grid=grid,
        vp_stage=vp_stage,
    )


def datasets_provider(args, tokenizer, num_samples: tuple[int, int, int], grid) -> list[Any]:
    from .data import GPTDatasetConfig, build_train_valid_test_datasets

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        eod=tokenizer.eod,
        pad=tokenizer.pad,
        path_to_cache=args.data_cache_path,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        mmap_bin_files=args.mmap_bin_files,
    )
    return build_train_valid_test_datasets(
        args.data_path,
        args.split,
        num_samples,
        config,
        group=grid.host_group,
        mock=args.mock_data,
        mock_max_token=tokenizer.vocab_size - 1,
    )


def _num_samples(args) -> tuple[int, int, int]:
    """Samples of the train / valid / test splits (Megatron's): the validation set serves
    every --eval-interval evaluation and the one after training; the test set, one
    evaluation after training."""
    gbs = args.global_batch_size
    rounds = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    return args.train_iters * gbs, rounds * args.eval_iters * gbs, args.eval_iters * gbs


def _consumed_valid_samples(args, iteration: int) -> int:
    """Where a resumed run's validation loader starts: after the evaluations of the
    iterations already run (Megatron's count; the one after training is never saved)."""
    if not args.eval_interval:
        return 0
    return (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size


def _loader_factory(args, grid, dataset, consumed: int):
    from .data import build_pretraining_data_loader

    if dataset is None:
        return None
    return partial(
        build_pretraining_data_loader,
        dataset,
        consumed,
        args.micro_batch_size,
        grid.rank("dp"),
        grid.size("dp"),
        args.dataloader_type,
        args.num_workers,
        args.seed,
        grid.device.type == "cuda",
    )


def pretrain(
    args: argparse.Namespace,
    *,
    logger_factory=None,
    forward_step_func=None,
    cuda_graph_capture=None,
):
    """Train per `args` (validated); returns the final TrainState.

    `cuda_graph_capture`: with --enable-cuda-graph, the function that captures a layer's
    work (default `pentatron.models.cuda_graphs.cuda_capture`, torch.cuda.graph)."""
    grid = initialize(args)
    resolve_data(args, grid)
    tokenizer = build_tokenizer_for(args)
    vocab_size = _model_vocab_size(args, tokenizer)
    provider = partial(model_provider, args, grid, vocab_size)
    chunks, optimizer, scheduler = setup_model_and_optimizer(provider, args, grid)
    config = configs.transformer_config(args)
    state = TrainState()
    loaded = _load(args, chunks, optimizer, scheduler, grid, config)
    if loaded is None and args.pretrained_checkpoint:
        loaded = _load_pretrained(args, chunks, optimizer, scheduler, grid, config)
    if loaded is not None:
        state.iteration, state.consumed_samples = loaded.iteration, loaded.consumed_samples
    train_ds, valid_ds, test_ds = datasets_provider(args, tokenizer, _num_samples(args), grid)
    train_factory = _loader_factory(args, grid, train_ds, state.consumed_samples)
    valid_start = _consumed_valid_samples(args, state.iteration)
    valid_factory = _loader_factory(args, grid, valid_ds, valid_start)
    test_factory = _loader_factory(args, grid, test_ds, 0)
    forward_step = forward_step_func or make_forward_step(
        grid, args.micro_batch_size, args.seq_length
    )
    logger = (logger_factory or default_logger)(args, grid, chunks)
    async_saver = None
    if args.save and args.async_save:
        from .checkpointing import AsyncSaver

        async_saver = AsyncSaver(grid)
    trainer = Trainer(
        args=args,
        grid=grid,
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        forward_step=forward_step,
        pcfg=make_pipeline_config(args, chunks, grid, configs.pipeline_config, optimizer),
        train_iters=build_iterators(train_factory, args, grid),
        valid_iters=build_iterators(valid_factory, args, grid) if valid_factory else None,
        test_iters=build_iterators(test_factory, args, grid) if test_factory else None,
        logger=logger,
        save=_saver(args, chunks, optimizer, scheduler, grid, config, async_saver),
        async_saver=async_saver,
        cuda_graphs=_cuda_graphs(args, chunks, cuda_graph_capture),
    )
    in_step = False  # every rank leaves train() at the same point: collectives in step
    try:
        state = trainer.train(state)
        in_step = True
        if args.export_hf_dir and state.exit_reason == "train-iters":
            from .hf.export import export_hf

            export_hf(args, chunks, grid, config, vocab_size)
        return state
    except NonFiniteLossError:
        in_step = True
        raise
    finally:
        logger.close()
        if async_saver is not None:
            # In step: publish a save in flight, join the writer thread, destroy its group.
            # Else (an error, maybe on this rank alone) nothing collective: the writer thread
            # ends after its current write and `main` ends the rest.
            async_saver.close(finish=in_step)


def _cuda_graphs(args, chunks, capture):
    if not args.enable_cuda_graph:
        return None
    from pentatron.models.cuda_graphs import LayerCudaGraphs, cuda_capture

    return LayerCudaGraphs(chunks, args.cuda_graph_warmup_steps, capture or cuda_capture)


def _model_vocab_size(args, tokenizer) -> int:
    """The tokenizer's vocabulary, or a Hugging Face checkpoint's embedding rows (which may
    exceed the tokenizer's: Qwen2 pads them) when the run starts from one."""
    if args.pretrained_kind != "hf":
        return tokenizer.vocab_size
    from .hf.config import PretrainedConfigError, hf_config

    rows = hf_config(args.pretrained_checkpoint)[1]
    if tokenizer.vocab_size > rows:
        raise PretrainedConfigError(
            f"--pretrained-checkpoint {args.pretrained_checkpoint}: its {rows} embedding rows "
            f"are fewer than the tokenizer's {tokenizer.vocab_size} ids; fix: use the "
            "checkpoint's tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
            "the same directory)"
        )
    return rows


def _load_pretrained(args, chunks, optimizer, scheduler, grid, config):
    """--pretrained-checkpoint when --load holds no checkpoint (Megatron's rule): the
    weights only, iteration 0, fresh optimizer state and schedule."""
    from .checkpointing import LoadedCheckpoint, load_checkpoint

    path = args.pretrained_checkpoint
    if dist.get_rank() == 0:
        print(f"> no checkpoint in --load: starting from --pretrained-checkpoint {path}")
    if args.pretrained_kind == "hf":
        from .hf.load import load_hf_weights

        load_hf_weights(path, chunks, optimizer)
        return LoadedCheckpoint(0, 0)
    return load_checkpoint(
        path,
        chunks,
        optimizer,
        scheduler,
        grid=grid,
        config=config,
        finetune=True,
        strictness=args.dist_ckpt_strictness,
    )


def _load(args, chunks, optimizer, scheduler, grid, config):
    """--load (with --no-load-optim, --no-load-rng, --finetune, --ckpt-step), or None."""
    if not args.load:
        return None
    from .checkpointing import load_checkpoint

    return load_checkpoint(
        args.load,
        chunks,
        optimizer,
        scheduler,
        grid=grid,
        config=config,
        load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng,
        finetune=args.finetune,
        iteration=args.ckpt_step,
        strictness=args.dist_ckpt_strictness,
        auto_detect_format=args.auto_detect_ckpt_format,
    )


def _saver(args, chunks, optimizer, scheduler, grid, config, async_saver=None):
    if not args.save:
        return None
    from .checkpointing import save_checkpoint

    def save(state: TrainState) -> None:
        save_checkpoint(
            args.save,
            state.iteration,
            chunks,
            None if args.no_save_optim else optimizer,
            scheduler,
            grid=grid,
            config=config,
            consumed_samples=state.consumed_samples,
            args={
                k: list(v) if isinstance(v, tuple) else v
                for k, v in vars(args).items()
                if _jsonable(v)
            },
            keep_last=args.ckpt_keep_last,
            async_saver=async_saver,
        )

    return save


def _jsonable(v: Any) -> bool:
    """Saved with the checkpoint: plain values, and lists or tuples of them (a tuple, e.g.
    --window-size, is saved as a list; the flags take either)."""
    return (
        v is None
        or isinstance(v, (bool, int, float, str))
        or (isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v))
    )


def default_logger(args, grid, chunks):
    """The metrics logger; it writes on the last rank only (it holds the loss, as in
    Megatron). JSONL goes to --log-jsonl, else <--save>/metrics.jsonl, else nowhere."""
    from pentatron.models import num_floating_point_operations

    from .arguments_logging import logger_kwargs
    from .metrics import TrainingLogger

    model = chunks[-1].module
    jsonl = args.log_jsonl or (os.path.join(args.save, "metrics.jsonl") if args.save else None)
    world = dist.get_world_size()
    return TrainingLogger(
        log_interval=args.log_interval,
        train_iters=args.train_iters,
        jsonl_path=jsonl,
        tensorboard_dir=args.tensorboard_dir,
        enabled=dist.get_rank() == world - 1,
        progress=not args.no_progress,
        flops_per_iteration=num_floating_point_operations(
            model.config, args.seq_length, model.padded_vocab_size, args.global_batch_size
        ),
        tokens_per_iteration=args.global_batch_size * args.seq_length,
        world_size=world,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        **logger_kwargs(args),
    )


# Exit statuses of `main` (torchrun itself exits 1 when a worker exits non-zero).
EXIT_OK = 0  # train-iters, --exit-interval, --exit-duration-in-mins, SIGTERM/SIGINT
EXIT_ERROR = 1  # an exception (traceback printed)
EXIT_BAD_ARGUMENTS = 2  # a flag or a combination of flags, one line, before any group
EXIT_NON_FINITE = 3  # the loss or a grad went NaN/Inf (--on-nan-loss stop), one line
# After an error on one rank, destroying a group can wait for a collective the other ranks
# will never join; past this many seconds the process exits without Python's shutdown.
ERROR_SHUTDOWN_S = 10.0


def main(argv: list[str] | None = None) -> int:
    """Run `pretrain`, then end cleanly: every process group destroyed (sub-groups first,
    then the default group) and no collective thread left running, on every exit path."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = validate_args(parse_args(argv), world, cuda=torch.cuda.is_available())
    except ArgumentError as e:
        print(f"pentatron-pretrain: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    if int(os.environ.get("RANK", "0")) == 0:
        for note in args.startup_notes:  # Megatron flags that select what runs anyway
            print(f"pentatron-pretrain: note: {note}", flush=True)
    state, code = None, EXIT_OK
    try:
        state = pretrain(args)
    except NonFiniteLossError as e:  # raised on every rank at the same iteration
        print(f"pentatron-pretrain: error: {e}", file=sys.stderr)
        code = EXIT_NON_FINITE
    except BaseException:  # maybe on this rank alone: other ranks may never join its work
        traceback.print_exc()
        code = EXIT_ERROR
    # Outside the except blocks: the traceback (and the frames holding groups) is gone.
    if code == EXIT_ERROR:
        _end_after_error()
        return EXIT_ERROR
    rank = dist.get_rank()
    if not shutdown():
        print(
            f"pentatron-pretrain: warning: rank {rank}: threads of destroyed process groups "
            f"are still alive ({', '.join(gloo_threads())}); something still holds a group",
            file=sys.stderr,
        )
    if state is not None and rank == 0:
        print(f"done: {state.iteration} iterations ({state.exit_reason})")
    return code


def _end_after_error() -> None:
    """The clean end, bounded: after an error on this rank alone, a group's queued
    collective or the checkpoint writer's may wait for ranks that will never join, and so
    would Python's own exit (it joins threads). Past ERROR_SHUTDOWN_S the process exits at
    once, without Python's shutdown (so no thread can run into it either)."""
    deadline = time.monotonic() + ERROR_SHUTDOWN_S
    clean = shutdown(timeout=ERROR_SHUTDOWN_S)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
            clean = clean and not thread.is_alive()
    if not clean:
        print(
            f"pentatron-pretrain: process groups or threads still busy after "
            f"{ERROR_SHUTDOWN_S:.0f} s (work other ranks will not join); exiting now",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_ERROR)
