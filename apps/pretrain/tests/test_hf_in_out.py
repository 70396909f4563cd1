"""Hugging Face in, Hugging Face out: --pretrained-checkpoint reads a `save_pretrained`
directory at any layout, --export-hf-dir writes one `from_pretrained` loads.

References are independent of our code: transformers' own Llama computes the loss of the
app's first batch, and the logits of the exported model; the app's model computes its own
logits with its own forward. fp32 throughout.

- --lr 0 at tp2-pp2-dp2 (distributed optimizer): the exported tensors equal the input
  bitwise; the first iteration's loss equals transformers' on the same batch (rtol 1e-5).
- --lr 1e-3, 10 steps at tp2-dp2: transformers' logits of the exported model equal the
  app's final model's (rtol 1e-4 of the largest logit).
- Bad input: a model flag that contradicts config.json, and a checkpoint missing tensors,
  fail in flag validation (before any collective) naming the flag / the tensors.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _app import train_record

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, GBS = 96, 16, 8
FLAGS = [
    "--use-checkpoint-args",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    str(VOCAB),
    "--seq-length",
    str(SEQ),
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    str(GBS),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--transformer-impl",
    "local",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
    "--seed",
    "3",
]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _save_llama(path: str, tie: bool = False, max_positions: int = 64) -> None:
    """A 4-layer GQA Llama (untied unless `tie`), random weights, `save_pretrained`."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a dropped or transposed norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)


def _save_moe(path: str, arch: str) -> None:
    """A 4-layer Mixtral or Qwen2-MoE (4 experts, top-2; Qwen2-MoE: a gated shared expert
    and q/k/v biases), random weights, `save_pretrained`."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=False,
            **common,
        )
        cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(12)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)


def _save_gpt_oss(path: str) -> None:
    """A 4-layer gpt-oss (4 experts top-2 with biases, learnable sinks, a 4-key window on
    layers 1 and 3, YaRN, a clamp that acts), random weights, `save_pretrained`."""
    _gpt_oss(24).save_pretrained(path, safe_serialization=True)


def _save_gpt_oss_mxfp4(plain: str, mxfp4: str) -> None:
    """`_save_gpt_oss`'s kind of model (expert width 32: MXFP4 blocks are 32 wide) whose
    expert weights are random MXFP4 values: `plain` holds them dequantised
    (`save_pretrained`), `mxfp4` as OpenAI's release stores them (uint8 blocks and scales,
    `quantization_config` mxfp4)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, g = _gpt_oss(32), torch.Generator().manual_seed(16)
    files = dict(model.state_dict())
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}.mlp.experts."
        for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):  # [E, out, in / 32, 16]
            blocks = torch.randint(0, 256, (4, rows, 1, 16), generator=g).to(torch.uint8)
            scales = torch.randint(120, 125, (4, rows, 1), generator=g).to(torch.uint8)
            values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(values)
            del files[pre + name]
            files[pre + name + "_blocks"], files[pre + name + "_scales"] = blocks, scales
    model.save_pretrained(plain, safe_serialization=True)
    os.makedirs(mxfp4)
    save_file({k: v.contiguous() for k, v in files.items()}, f"{mxfp4}/model.safetensors")
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    with open(f"{mxfp4}/config.json", "w") as f:
        json.dump(config, f)


def _gpt_oss(ffn: int):
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=ffn,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.5,
        max_position_embeddings=64 * 32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(15)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _save_deepseek(path: str, mtp: bool = False) -> None:
    """A 4-layer DeepSeek-V3 (MLA with q latent, a dense first layer, 4 experts top-2 in 2
    groups, sigmoid scores with a random correction bias, a shared expert), random weights,
    `save_pretrained`; with `mtp`, one MTP depth added to the files as DeepSeek's release
    holds it (transformers builds no module for it)."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(13)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "norm" in name or "e_score_correction_bias" in name:
                t.add_(torch.randn_like(t) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    if mtp:
        from safetensors.torch import save_file

        state, g = _safetensors(path), torch.Generator().manual_seed(14)
        extra = {
            k.replace("layers.3.", "layers.4."): v.clone()
            for k, v in state.items()
            if k.startswith("model.layers.3.")
        }
        extra["model.layers.4.enorm.weight"] = 1 + 0.2 * torch.randn(32, generator=g)
        extra["model.layers.4.hnorm.weight"] = 1 + 0.2 * torch.randn(32, generator=g)
        extra["model.layers.4.eh_proj.weight"] = 0.02 * torch.randn(32, 64, generator=g)
        extra["model.layers.4.shared_head.norm.weight"] = torch.ones(32)
        extra["model.layers.4.embed_tokens.weight"] = state["model.embed_tokens.weight"]
        extra["model.layers.4.shared_head.head.weight"] = state["lm_head.weight"]
        save_file(extra, os.path.join(path, "mtp.safetensors"))
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                index = json.load(f)
        else:  # one file: make the index that lists both
            index = {"metadata": {}, "weight_map": dict.fromkeys(state, "model.safetensors")}
        index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
        with open(index_path, "w") as f:
            json.dump(index, f)
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
        d["num_nextn_predict_layers"] = 1
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f)


def _argv(hf: str, *extra: str) -> list[str]:
    return ["--pretrained-checkpoint", hf, *FLAGS, *extra]


def _first_batch(argv: list[str], world: int) -> dict[str, torch.Tensor]:
    """The app's first global batch (samples 0..GBS-1 of the train split, whatever the
    layout), built by the app's own dataset code in this process."""
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import (
        _num_samples,
        build_tokenizer_for,
        datasets_provider,
    )

    args = validate_args(parse_args(argv), world)
    train, _, _ = datasets_provider(
        args, build_tokenizer_for(args), _num_samples(args), types.SimpleNamespace(host_group=None)
    )
    samples = [train[i] for i in range(GBS)]
    return {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask")}


def _transformers_loss(hf_dir: str, batch: dict[str, torch.Tensor]) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().float()
    return float((ce * mask).sum() / mask.sum())


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(path, f)).items():
                assert k not in out, f"{k} written twice"
                out[k] = v
    return out


def _assert_first_loss(per_rank: list[dict], hf: str, argv: list[str], ranks: int) -> None:
    """Every last-stage rank (`ranks` of them) logged transformers' loss of the batch."""
    losses = [r["losses"][0] for r in per_rank if r["losses"][0] is not None]
    assert len(losses) == ranks
    want = _transformers_loss(hf, _first_batch(argv, len(per_rank)))
    for loss in losses:
        assert loss == pytest.approx(want, rel=1e-5)


def _assert_same_tensors(expected: str, got: str) -> None:
    """The safetensors of two directories hold the same names and bitwise the same values."""
    given, exported = _safetensors(expected), _safetensors(got)
    assert sorted(exported) == sorted(given)
    for name, tensor in given.items():
        assert torch.equal(exported[name], tensor), name


ZBV = ["--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize(
    ("tie", "schedule"),
    [(False, []), (True, []), (False, ZBV)],
    ids=["untied", "tied", "untied-zbv"],  # ZBV: rank 0 holds layers 0 and 3, the head
)
def test_lr0_round_trip_is_bitwise_and_first_loss_is_transformers(
    distributed, tmp_path, tie, schedule
):
    hf, out = str(tmp_path / "hf"), str(tmp_path / "out")
    _save_llama(hf, tie)
    argv = _argv(hf, *TP2_PP2, "--use-distributed-optimizer", "--lr", "0", "--train-iters", "1")
    argv += schedule
    per_rank = distributed.run(8, train_record, [*argv, "--export-hf-dir", out])
    _assert_first_loss(per_rank, hf, argv, 4)  # the last stage's tp2 x dp2 ranks
    _assert_same_tensors(hf, out)
    # transformers reads the export as the model it was
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert again.config.tie_word_embeddings is tie and again.config.num_key_value_heads == 2


SAVE = {"deepseek_v3": _save_deepseek, "gpt_oss": _save_gpt_oss}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_moe_lr0_round_trip_at_ep2(distributed, tmp_path, arch):
    """MoE at tp2-pp2-dp2 with ep2 (experts split over the dp ranks of a stage)."""
    hf, out = str(tmp_path / "hf"), str(tmp_path / "out")
    SAVE[arch](hf) if arch in SAVE else _save_moe(hf, arch)
    argv = _argv(hf, *TP2_PP2, "--expert-model-parallel-size", "2", "--sequence-parallel")
    argv += ["--lr", "0"]
    argv += ["--train-iters", "1", "--use-distributed-optimizer"]
    per_rank = distributed.run(8, train_record, [*argv, "--export-hf-dir", out])
    _assert_first_loss(per_rank, hf, argv, 4)
    if arch != "deepseek_v3":
        _assert_same_tensors(hf, out)
        return
    # without lr, only DeepSeek's correction bias moves: one balancing step of 1e-3
    given, exported = _safetensors(hf), _safetensors(out)
    assert sorted(exported) == sorted(given)
    for name, tensor in given.items():
        if name.endswith("e_score_correction_bias"):
            step = (exported[name] - tensor).abs()
            assert torch.allclose(step[step > 0], torch.tensor(1e-3), atol=1e-7), name
            assert step.max() > 0, name
        else:
            assert torch.equal(exported[name], tensor), name


def test_gpt_oss_mxfp4_release_starts_a_run_and_exports_dequantised(distributed, tmp_path):
    """OpenAI's MXFP4 expert files pass the completeness check, load dequantised at ep2
    (transformers' first loss on the same values saved plain) and export as the plain
    save_pretrained directory, bitwise."""
    plain, mxfp4, out = (str(tmp_path / n) for n in ("plain", "mxfp4", "out"))
    _save_gpt_oss_mxfp4(plain, mxfp4)
    argv = _argv(mxfp4, "--expert-model-parallel-size", "2", "--lr", "0", "--train-iters", "1")
    per_rank = distributed.run(2, train_record, [*argv, "--export-hf-dir", out])
    _assert_first_loss(per_rank, plain, argv, 2)
    _assert_same_tensors(plain, out)


@pytest.mark.parametrize(
    "layout",
    [
        ["--cp-comm-type", "p2p", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--cp-comm-type", "all_gather", "--pipeline-model-parallel-size", "2"],
    ],
    ids=["cp2-p2p-tp2-sp", "cp2-all_gather-pp2"],
)
def test_gpt_oss_at_cp2_with_blockwise_kinds_has_transformers_first_loss(
    distributed, tmp_path, layout
):
    """The ring and all-gather kinds carry gpt-oss's sinks and windows (sinks folded into
    the merged softmax, chunk pairs masked by global positions): transformers' loss."""
    hf = str(tmp_path / "hf")
    _save_gpt_oss(hf)
    argv = _argv(hf, "--context-parallel-size", "2", *layout, "--lr", "0", "--train-iters", "1")
    per_rank = distributed.run(4, train_record, argv)
    _assert_first_loss(per_rank, hf, argv, 4 if "--tensor-model-parallel-size" in layout else 2)


def test_deepseek_mtp_layers_come_in_and_go_out(distributed, tmp_path):
    """A checkpoint holding DeepSeek's MTP depth: --use-checkpoint-args turns MTP on, the
    MTP stage (pp2, with its embedding copy) reads it, its loss is logged, and the export
    writes it back (bitwise, but the correction biases' one balancing step)."""
    hf, out = str(tmp_path / "hf"), str(tmp_path / "out")
    _save_deepseek(hf, mtp=True)
    argv = _argv(hf, "--pipeline-model-parallel-size", "2", "--lr", "0", "--train-iters", "1")
    assert _validate(argv, 2).mtp_num_layers == 1
    per_rank = distributed.run(2, train_record, [*argv, "--export-hf-dir", out])
    _assert_first_loss(per_rank, hf, argv, 1)
    (mtp,) = [r["mtp_losses"][0] for r in per_rank if r["mtp_losses"][0] is not None]
    assert 0 < mtp["mtp_1 loss"] < 10
    given, exported = _safetensors(hf), _safetensors(out)
    assert sorted(exported) == sorted(given)
    for name, tensor in given.items():
        if not name.endswith("e_score_correction_bias"):
            assert torch.equal(exported[name], tensor), name


def test_fsdp2_run_starts_from_the_hf_weights(distributed, tmp_path):
    """With FSDP2 each dp rank keeps only its rows of the shard it read (tp2 x dp2 here)."""
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    argv = _argv(hf, "--tensor-model-parallel-size", "2", "--use-torch-fsdp2")
    argv += ["--lr", "0", "--train-iters", "1"]
    _assert_first_loss(distributed.run(4, train_record, argv), hf, argv, 4)
    with pytest.raises(ValueError, match="checkpoint-to-hf"):
        _validate([*argv, "--export-hf-dir", str(tmp_path / "out")], 4)


def _app_logits(model, grid, ids: torch.Tensor) -> torch.Tensor | None:
    """The app model's logits `[b, s, V]` of `ids` (None off the last stage): with pp2 the
    first stage's hidden states go to the second by a plain send / recv."""
    import torch.distributed as dist

    pos = torch.arange(ids.size(1)).expand_as(ids)
    if grid.size("pp") == 1:
        return model(ids, pos, gather_logits=True)[..., :VOCAB]
    first, last = grid.ranks("pp")
    if grid.rank("pp") == 0:
        dist.send(model(ids, pos).contiguous(), dst=last)  # [s, b, h]
        return None
    hidden = torch.empty(ids.size(1), ids.size(0), model.config.hidden_size)
    dist.recv(hidden, src=first)
    model.set_input_tensor(hidden)
    return model(ids, pos, gather_logits=True)[..., :VOCAB]


def _train_and_logits(argv: list[str], ids: torch.Tensor):
    """Train with the app; then the final model's logits of `ids`, by the app's forward."""
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import default_logger, pretrain

    kept = {}

    def logger(args, grid, chunks):
        kept.update(grid=grid, chunks=chunks)
        return default_logger(args, grid, chunks)

    args = validate_args(parse_args(argv), dist.get_world_size())
    try:
        state = pretrain(args, logger_factory=logger)
        (chunk,) = kept["chunks"]
        chunk.module.eval()
        with torch.no_grad():
            logits = _app_logits(chunk.module, kept["grid"], ids)
    finally:
        destroy_model_parallel()
    return state.losses, logits


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_trained_model_exports_with_the_same_logits(distributed, tmp_path, arch):
    """10 steps (DeepSeek-V3: 20, the loss falling over them); Llama at tp2-pp2-dp2, MoE at
    tp2-dp2 with SP and ep2; the app's final model (its own forward) vs transformers on its
    export."""
    hf, out = str(tmp_path / "hf"), str(tmp_path / "out")
    if arch == "llama":
        _save_llama(hf)
    else:
        _save_deepseek(hf) if arch == "deepseek_v3" else _save_moe(hf, arch)
    if arch == "llama":
        world, layout = 8, TP2_PP2
    else:
        world, layout = 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        layout += ["--expert-model-parallel-size", "2"]
    steps = "20" if arch == "deepseek_v3" else "10"
    argv = _argv(hf, *layout, "--lr", "1e-3", "--train-iters", steps, "--export-hf-dir", out)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    results = distributed.run(world, _train_and_logits, argv, ids)
    losses, app_logits = next(r for r in results if r[1] is not None)  # a last-stage rank
    assert losses[-1] < losses[0]  # it trained
    if arch == "deepseek_v3":  # and kept learning: each fifth of the run below the one before
        fifths = [sum(losses[i : i + 4]) for i in range(0, 20, 4)]
        assert all(b < a for a, b in itertools.pairwise(fifths)), fifths
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits
    scale = hf_logits.abs().max()
    torch.testing.assert_close(app_logits / scale, hf_logits / scale, rtol=0, atol=1e-4)
    given = _safetensors(hf)
    changed = [k for k, v in _safetensors(out).items() if not torch.equal(v, given[k])]
    assert len(changed) == len(given)  # every tensor trained, so every one was exported


def test_vpp_and_context_parallel_runs_start_from_the_hf_weights(distributed, tmp_path):
    """tp2 x pp2 with 2 virtual stages x cp2 (world 8): transformers' first loss."""
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    argv = _argv(hf, *TP2_PP2, "--num-layers-per-virtual-pipeline-stage", "1")
    argv += ["--context-parallel-size", "2", "--lr", "0", "--train-iters", "1"]
    per_rank = distributed.run(8, train_record, argv)
    _assert_first_loss(per_rank, hf, argv, 4)


def _resumed(root: str, argv: list[str]) -> tuple[dict, dict, dict]:
    ckpt = os.path.join(root, "ckpt")
    full = train_record(argv)
    with_ckpt = [*argv, "--save", ckpt, "--load", ckpt, "--save-interval", "2"]
    first = train_record([*with_ckpt, "--exit-interval", "2"])
    second = train_record(with_ckpt)  # --load now holds this run's checkpoint: it wins
    return full, first, second


def test_a_rerun_resumes_from_load_not_from_the_pretrained_weights(distributed, tmp_path):
    """Megatron's rule: --pretrained-checkpoint only while --load holds no checkpoint."""
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    argv = _argv(hf, "--lr", "1e-3", "--train-iters", "4")
    for full, first, second in distributed.run(2, _resumed, str(tmp_path), argv):
        assert first["losses"] == full["losses"][:2]
        assert second["losses"] == full["losses"][2:]  # bitwise: weights, Adam, schedule
        assert second["grad_norms"] == full["grad_norms"][2:]


def _validate(argv: list[str], world: int = 1):
    from pentatron.pretrain.arguments import parse_args, validate_args

    return validate_args(parse_args(argv), world)


def test_use_checkpoint_args_fills_only_the_flags_not_given(tmp_path):
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    args = _validate(_argv(hf, "--lr", "1e-3", "--train-iters", "2"))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (4, 32, 4)
    assert (args.num_query_groups, args.ffn_hidden_size, args.norm_epsilon) == (2, 64, 1e-6)
    assert args.normalization == "RMSNorm" and args.swiglu and not args.add_bias_linear
    assert args.position_embedding_type == "rope" and args.untie_embeddings_and_output_weights
    assert args.max_position_embeddings == 64
    # a flag given keeps its value, and then must agree with config.json
    with pytest.raises(ValueError, match=r"^--num-layers: .*num_layers=2.*num_layers=4"):
        _validate(_argv(hf, "--lr", "1e-3", "--train-iters", "2", "--num-layers", "2"))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--normalization", "LayerNorm"], "--normalization"),
        (["--num-query-groups", "4"], "--num-query-groups"),
        (["--rotary-base", "500000"], "--rotary-base"),
        (["--ffn-hidden-size", "128"], "--ffn-hidden-size"),
        (["--softmax-type", "learnable"], "--softmax-type"),
        (["--window-size", "7,0"], "--window-size"),
    ],
)
def test_a_contradicting_model_flag_fails_in_validation(tmp_path, flags, named):
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    model = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
    model += ["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64"]
    model += ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu"]
    model += ["--disable-bias-linear", "--position-embedding-type", "rope"]
    model += ["--untie-embeddings-and-output-weights", "--max-position-embeddings", "64"]
    argv = ["--pretrained-checkpoint", hf, *FLAGS[1:], *model, "--lr", "1e-3"]
    argv += ["--train-iters", "2"]
    assert _validate(argv).num_layers == 4  # the flags as given agree with config.json
    with pytest.raises(ValueError, match="^" + re.escape(named) + "[ :]") as error:
        _validate([*argv, *flags])
    assert "\n" not in str(error.value) and "--use-checkpoint-args" in str(error.value)


def test_gpt_oss_flags_come_from_the_checkpoint_and_must_agree_with_it(tmp_path):
    """--use-checkpoint-args takes gpt-oss's activation, attention variants and YaRN from
    config.json; each of those flags given otherwise fails, named, before any collective."""
    hf = str(tmp_path / "hf")
    _save_gpt_oss(hf)
    base = _argv(hf, "--lr", "1e-3", "--train-iters", "2")
    args = _validate(base)
    assert args.quick_geglu and not args.swiglu and args.glu_linear_offset == 1.0
    assert args.activation_func_clamp_value == 0.5 and args.softmax_type == "learnable"
    assert tuple(args.window_size) == (3, 0) and args.window_attn_skip_freq == 2
    assert (args.position_embedding_type, args.rotary_scaling_factor) == ("yarn", 32.0)
    assert args.yarn_original_max_position_embeddings == 64
    assert args.yarn_correction_range_round_to_int is False
    assert args.num_experts == 4 and args.add_bias_linear
    for flags, named in (
        (["--window-size", "7,0"], "--window-size"),
        (["--window-attn-skip-freq", "3"], "--window-attn-skip-freq"),
        (["--softmax-type", "off-by-one"], "--softmax-type"),
        (["--activation-func-clamp-value", "7.0"], "--activation-func-clamp-value"),
        (["--glu-linear-offset", "0"], "--glu-linear-offset"),
        (["--yarn-beta-fast", "16"], "--yarn-beta-fast"),
        (["--yarn-correction-range-round-to-int"], "--yarn-correction-range-round-to-int"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(named) + "[ :]"):
            _validate([*base, *flags])


def test_a_partial_checkpoint_fails_in_validation_naming_the_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = str(tmp_path / "hf")
    _save_llama(hf)
    (file,) = [f for f in os.listdir(hf) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(hf, file))
    del tensors["model.layers.2.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, os.path.join(hf, file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lack 2 tensors") as error:
        _validate(_argv(hf, "--lr", "1e-3", "--train-iters", "2"))
    assert "lm_head.weight" in str(error.value)
    assert "model.layers.2.mlp.up_proj.weight" in str(error.value)


def test_export_dir_must_be_new_and_pretrained_must_be_a_checkpoint(tmp_path):
    hf = str(tmp_path / "hf")
    _save_llama(hf)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    base = _argv(hf, "--lr", "1e-3", "--train-iters", "2")
    with pytest.raises(ValueError, match=r"^--export-hf-dir=.*not an empty directory"):
        _validate([*base, "--export-hf-dir", str(tmp_path / "used")])
    with pytest.raises(ValueError, match="neither a Hugging Face directory"):
        _validate(_argv(str(tmp_path / "used"), "--lr", "1e-3", "--train-iters", "2"))
    with pytest.raises(ValueError, match=r"^--use-checkpoint-args: "):
        _validate([*FLAGS, "--lr", "1e-3"])


def _readme_commands() -> list[str]:
    readme = Path(__file__).resolve().parents[3] / "README.md"
    text = readme.read_text()
    block = text.split("<!-- hf-continue -->", 1)[1].split("```", 2)[1]
    return [line for line in block.strip().splitlines() if line.strip()]


@pytest.mark.checkout
def test_readme_continue_pretraining_commands_run(tmp_path):
    """The README's two commands, as written, on a tiny Llama with a tokenizer.json."""
    from _tokenizer_files import LINES, hf_word_level

    _save_llama(str(tmp_path / "my-llama"), max_positions=512)
    hf_word_level(tmp_path / "my-llama")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES))
    commands = _readme_commands()
    assert len(commands) == 2
    bin_dir = os.path.join(sys.prefix, "bin") + os.sep
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in commands:
        argv = shlex.split(command.replace(".venv/bin/", bin_dir))
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "my-llama-continued"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("the quick fox")["input_ids"][0] == 1  # <s>, from the copied files
    assert model.dtype == torch.bfloat16  # --bf16: the weights as trained
    before = _safetensors(str(tmp_path / "my-llama"))
    after = _safetensors(str(out))
    assert sorted(after) == sorted(before)
    assert any(not torch.equal(after[k], before[k].to(after[k].dtype)) for k in before)


def _convert(*argv: str) -> None:
    from pentatron.models.hf.cli import main

    assert main(list(argv)) == 0


@pytest.mark.parametrize("arch", ["llama", "mixtral", "deepseek_v3-mtp", "gpt_oss"])
def test_checkpoint_converts_offline_to_what_the_run_exported(distributed, tmp_path, arch):
    """A tp2-pp2-dp2 run (ep2 for the MoE models; DeepSeek-V3 with its MTP depth on the
    last stage; gpt-oss with its sinks split over tp) saves its checkpoint and exports; the
    offline conversion of the checkpoint
    (DCP read of the global tensors, one layer at a time) equals the export (all-gathered
    from the live shards) bitwise, config.json too."""
    hf, out, ckpt, conv = (str(tmp_path / n) for n in ("hf", "out", "ckpt", "conv"))
    if arch == "llama":
        _save_llama(hf)
    elif arch == "gpt_oss":
        _save_gpt_oss(hf)
    else:
        _save_deepseek(hf, mtp=True) if arch.startswith("deepseek") else _save_moe(hf, arch)
    moe = ["--expert-model-parallel-size", "2", "--sequence-parallel"] if arch != "llama" else []
    argv = _argv(hf, *TP2_PP2, *moe, "--lr", "1e-3", "--train-iters", "3", "--save", ckpt)
    distributed.run(8, train_record, [*argv, "--export-hf-dir", out])
    _convert("checkpoint-to-hf", "--load", ckpt, "--out", conv)
    _assert_same_tensors(out, conv)
    assert json.loads((tmp_path / "conv" / "config.json").read_text()) == json.loads(
        (tmp_path / "out" / "config.json").read_text()
    )


def test_hf_converted_to_a_checkpoint_starts_a_run_like_the_hf_directory(distributed, tmp_path):
    """hf-to-checkpoint writes iteration 0 of an app checkpoint; a run started from it
    (--pretrained-checkpoint, model flags from its saved args) at tp2-pp2-dp2 with --lr 0
    has transformers' first loss and exports the Hugging Face tensors back bitwise."""
    hf, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    _save_llama(hf)
    _convert("hf-to-checkpoint", "--hf", hf, "--save", ckpt)
    argv = ["--pretrained-checkpoint", ckpt, *FLAGS, *TP2_PP2, "--lr", "0", "--train-iters", "1"]
    per_rank = distributed.run(8, train_record, [*argv, "--export-hf-dir", out])
    _assert_first_loss(per_rank, hf, argv, 4)
    _assert_same_tensors(hf, out)


def test_llama3_rope_scaling_maps_to_megatrons_flags(tmp_path):
    """Llama 3.1's rope_scaling is --use-rope-scaling --rope-scaling-factor F; other
    scaling constants than Megatron's fixed ones are refused by name."""
    from pentatron.pretrain.training.configs import transformer_config

    hf = tmp_path / "hf"
    _save_llama(str(hf), max_positions=256)
    config = json.loads((hf / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    (hf / "config.json").write_text(json.dumps(config))
    args = _validate(_argv(str(hf), "--lr", "1e-3", "--train-iters", "2"))
    assert args.use_rope_scaling and args.rope_scaling_factor == 32.0
    assert args.rotary_base == 500000.0
    rope = transformer_config(args).rope_scaling
    assert (rope.factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (
        32.0,
        4.0,
        8192,
    )
    config["rope_parameters"]["high_freq_factor"] = 2.0
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling"):
        _validate(_argv(str(hf), "--lr", "1e-3", "--train-iters", "2"))
