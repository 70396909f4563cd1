"""Multi-token prediction (`mtp_num_layers`, mtp.py).

- Independent reference: the MTP wiring written out here in plain PyTorch (inputs, labels
  and mask shifted k left with zeros, RMS norms, [embedding; hidden] concatenation,
  eh_proj, the output GEMM, masked means, weight / D), over the model's own decoder and
  MTP transformer layers: the main loss, each depth's loss and every parameter's gradient,
  two micro-batches accumulated with the aux-loss grad scale 1/2, fp32.
  Planted: a roll that wraps around instead of zero-filling, and an MTP loss that ignores
  the grad scale, each make it fail.
- Parallel parity against one process (rtol 1e-5 / atol 1e-6): tp2+SP, pp2 (tied and
  untied, learned positions: the last stage's embedding copy), tp2-pp2-vpp2+SP: per-token
  losses, each depth's (loss sum, count) and every gradient (each copy of a tied table).
- Bad input fails naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import DIVISIBLE_BY, TOL, VOCAB, B, S, build_reference, small_config, with_layout

from pentatron.models import (
    ModelConfigError,
    build_model_chunks,
    get_gpt_layer_local_spec,
    global_param_name,
    load_full_state_dict,
    merge_shards,
    mtp,
    set_aux_loss_scale,
    sync_grads,
)
from pentatron.models.hf import chunk_param_names
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.pipeline import PipelineConfig, get_forward_backward_func
from pentatron.tp_layers import model_parallel_seed

DEPTHS, M = 2, 2


def _config(**kw):
    return small_config(mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.3, **kw)


def _data(m: int = M, seed: int = 5):
    """(ids, positions, labels, loss mask) per micro-batch; the mask drops some tokens."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S).expand(B, S).contiguous()
    out = []
    for _ in range(m):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = torch.randint(0, VOCAB, (B, S), generator=g)
        mask = (torch.rand(B, S, generator=g) > 0.2).float()
        out.append((ids, pos, labels, mask))
    return out


# ---- the independent reference ---------------------------------------------------------------


def _shift(t: torch.Tensor, k: int) -> torch.Tensor:
    """t[:, i + k] at i, zeros at the last k positions."""
    return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _masked_mean_ce(h: torch.Tensor, w_out: torch.Tensor, labels, mask) -> torch.Tensor:
    logits = (h @ w_out.t()).transpose(0, 1)  # [b, s, V_pad]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def _by_hand(model, ids, pos, labels, mask):
    """(main loss, [depth losses], total) of the MTP recipe written out here."""
    c = model.config
    eps = c.layernorm_epsilon
    w_emb = model.embedding.word_embeddings.weight
    w_out = w_emb if model.share_embeddings_and_output_weights else model.output_layer.weight
    rope = model.position_embedding_type == "rope"
    rotary = model.rotary_pos_emb(pos, S) if rope else None
    h = model.decoder(model.embedding(ids, pos), None, rotary)
    main = _masked_mean_ce(h, w_out, labels, mask)
    depth_losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        e = F.embedding(_shift(ids, k), w_emb)  # [b, s, h]
        if not rope:  # learned positions, shifted with the inputs
            e = e + model.embedding.position_embeddings(_shift(pos, k))
        e = e.transpose(0, 1)  # [s, b, h]
        x = torch.cat([_rms(e, layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1)
        x = layer.mtp_model_layer(x @ layer.eh_proj.weight.t(), None, rotary)
        h = _rms(x, layer.final_layernorm.weight, eps)
        depth_losses.append(_masked_mean_ce(h, w_out, _shift(labels, k), _shift(mask, k)))
    total = main + c.mtp_loss_scaling_factor / len(depth_losses) * sum(depth_losses)
    return main, depth_losses, total


def _compare_with_hand_written(config):
    torch.manual_seed(0)
    ours = build_reference(config)
    hand = copy.deepcopy(ours)
    ours.train(), hand.train()
    set_aux_loss_scale(1.0 / M)  # what a schedule sets: the main loss is divided by M
    try:
        for ids, pos, labels, mask in _data():
            per_token = ours(ids, pos, labels=labels, loss_mask=mask)
            main = (per_token * mask).sum() / mask.sum()
            (main / M).backward()
            want_main, want_depths, total = _by_hand(hand, ids, pos, labels, mask)
            (total / M).backward()
            torch.testing.assert_close(main, want_main, **TOL)
            got_depths = [pair[0] / pair[1] for pair in ours.mtp_report]
            torch.testing.assert_close(torch.stack(got_depths), torch.stack(want_depths), **TOL)
    finally:
        set_aux_loss_scale(1.0)
    mine = dict(hand.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(
            p.grad, mine[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {
            "untie_embeddings_and_output_weights": True,
            "position_embedding_type": "learned_absolute",
        },
    ],
    ids=["tied-rope", "untied-learned"],
)
def test_matches_the_recipe_written_out(kw):
    _compare_with_hand_written(_config(**kw))


def test_a_wrapping_roll_is_caught(monkeypatch):
    """Planted: torch.roll without zero-filling (the first tokens come back at the end)."""
    monkeypatch.setattr(mtp, "roll_left", lambda t, group=None: torch.roll(t, -1, -1))
    with pytest.raises(AssertionError):
        _compare_with_hand_written(_config())


def test_an_mtp_loss_without_the_grad_scale_is_caught(monkeypatch):
    """Planted: the MTP loss back-propagated with grad 1 instead of the main loss's 1/M."""
    monkeypatch.setattr(mtp, "attach_aux_loss", _AttachWithGradOne.apply)
    with pytest.raises(AssertionError):
        _compare_with_hand_written(_config())


class _AttachWithGradOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, loss):
        ctx.save_for_backward(loss)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


# ---- parallel parity ---------------------------------------------------------------------------

LAYOUTS = [  # (tp, pp, vpp, sequence_parallel, tied, positions[, pipeline layout])
    (2, 1, None, True, True, "rope"),
    (1, 2, None, False, True, "rope"),
    (1, 2, None, False, False, "learned_absolute"),
    (2, 2, 2, True, True, "rope"),
    # Megatron's standalone MTP stage (custom layouts): the MTP layers, the final norm and
    # an embedding copy on pipeline rank 2, the loss on rank 3; h_0 and both depths'
    # outputs travel in one message
    (1, 4, None, False, False, "rope", "Et|t|ttmm|L"),
    (1, 4, 2, False, False, "learned_absolute", "Et|t|t|t|||mm|L"),  # rank 2's chunk 1
]


def _layout_config(base, layout):
    tp, pp, vpp, sp, tied, positions = layout[:6]
    custom = layout[6] if len(layout) > 6 else None
    return dataclasses.replace(
        with_layout(base, tp, pp, None if custom else vpp, sp),
        untie_embeddings_and_output_weights=not tied,
        position_embedding_type=positions,
        pipeline_model_parallel_layout=custom,
    )


def _parallel_config(config) -> ParallelConfig:
    """The grid of `config`; a standalone MTP stage's rank joins the embedding group."""
    rank = config.custom_layout().mtp_standalone_rank if config.mtp_standalone else None
    return ParallelConfig(
        tp=config.tensor_model_parallel_size,
        pp=config.pipeline_model_parallel_size,
        vpp=config.virtual_pipeline_model_parallel_size,
        embedding_pp_ranks=None if rank is None else (0, rank),
    )


def _forward_step(data_iterator, model):
    ids, pos, labels, mask = next(data_iterator)
    out = model(ids, pos, labels=labels, loss_mask=mask)
    report = list(model.mtp_report)

    def loss(output):
        reduced = {
            "losses": output.detach().clone(),
            "mtp": torch.stack(report) if report else None,
        }
        return (output * mask).sum() / mask.sum(), reduced

    return out, loss


def _case(grid, config, state, data, plant=None):
    chunks = build_model_chunks(
        config,
        get_gpt_layer_local_spec(config.qk_layernorm),
        VOCAB,
        S,
        grid,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    for chunk in chunks:
        load_full_state_dict(chunk, state)
        if plant == "untied-copy":  # the embedding and its MTP copy left out of the all-reduce
            for p in chunk.parameters():
                p.shared_embedding = False
    vpp = config.virtual_pipeline_model_parallel_size
    pcfg = PipelineConfig(
        hidden_size=config.hidden_size,
        sequence_parallel=config.sequence_parallel,
        finalize_model_grads_func=lambda model_chunks, tokens: sync_grads(model_chunks),
        aux_loss_scale_func=set_aux_loss_scale,
        variable_seq_lengths=config.mtp_standalone,  # the MTP stage sends (1 + D) s rows
    )
    func = get_forward_backward_func(config.pipeline_model_parallel_size, vpp)
    reduced = func(
        forward_step_func=_forward_step,
        data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
        model=chunks if vpp else chunks[0],
        num_microbatches=len(data),
        seq_length=S,
        micro_batch_size=B,
        config=pcfg,
        grid=grid,
    )
    grads = [
        (global_param_name(n, c.layer_offset), p.grad.clone())
        for c in chunks
        for n, p in c.named_parameters()
    ]
    names = None
    if config.position_embedding_type == "rope":  # (the converter's names have no positions)
        names = [
            (
                sorted(n for n, _ in c.named_parameters()),
                sorted(
                    chunk_param_names(
                        config,
                        pre_process=c.pre_process,
                        post_process=c.post_process,
                        layer_offset=c.layer_offset,
                        num_layers=len(c.decoder.layers),
                        mtp=config.mtp_on(grid.rank("pp"), c.vp_stage, c.post_process),
                        final_norm=config.final_norm_on(
                            grid.rank("pp"), c.vp_stage, c.post_process
                        ),
                    )
                ),
            )
            for c in chunks
        ]
    return {"tp_rank": grid.rank("tp"), "reduced": reduced, "grads": grads, "names": names}


def _all_layouts(base, layouts, states, data, plant=None):
    out = []
    for layout in layouts:
        config = _layout_config(base, layout)
        grid = initialize_model_parallel(_parallel_config(config))
        model_parallel_seed(1234 + 100 * grid.rank("pp"), grid)
        try:
            out.append(_case(grid, config, states[layout], data, plant))
        finally:
            destroy_model_parallel(grid)
    return out


def _reference(config, data):
    """Full state, per-token losses, depth reports and grads of one process (M micro-batches)."""
    model = build_reference(config)
    model.train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, reports = [], []
    set_aux_loss_scale(1.0 / len(data))
    try:
        for ids, pos, labels, mask in data:
            out = model(ids, pos, labels=labels, loss_mask=mask)
            ((out * mask).sum() / mask.sum() / len(data)).backward()
            losses.append(out.detach())
            reports.append(torch.stack(model.mtp_report))
    finally:
        set_aux_loss_scale(1.0)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return state, losses, reports, grads


def _check(config, results, ref):
    _, ref_losses, ref_reports, ref_grads = ref
    last = [r for r in results if r["reduced"]]
    assert last
    for r in last:
        for got, want_loss, want_report in zip(r["reduced"], ref_losses, ref_reports):
            torch.testing.assert_close(got["losses"], want_loss, **TOL)
            torch.testing.assert_close(got["mtp"], want_report, **TOL)
    copies: dict[str, dict[int, list[torch.Tensor]]] = {}
    for r in results:
        for name, grad in r["grads"]:
            if name == "output_layer.weight" and not config.untie_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"  # the last stage's tied copy
            copies.setdefault(name, {}).setdefault(r["tp_rank"], []).append(grad)
    assert sorted(copies) == sorted(ref_grads)
    for name, by_rank in copies.items():
        ranks = sorted(by_rank)
        for i in range(max(len(v) for v in by_rank.values())):  # every copy of the tensor
            shards = [by_rank[k][min(i, len(by_rank[k]) - 1)] for k in ranks]
            got = merge_shards(name, shards, config=config)
            torch.testing.assert_close(
                got, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.fixture(scope="module")
def mtp_parity(distributed):
    base, data = _config(), _data(4)
    refs = {
        lay: _reference(_layout_config(base, (1, 1, None, False, *lay[4:6])), data)
        for lay in LAYOUTS
    }
    states = {lay: ref[0] for lay, ref in refs.items()}
    per_rank = distributed.run(4, _all_layouts, base, LAYOUTS, states, data)
    return base, refs, {lay: [r[i] for r in per_rank] for i, lay in enumerate(LAYOUTS)}


@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=lambda lay: (
        "tp{}-pp{}-vpp{}-sp{}-tied{}-{}".format(*lay) + "".join(f"-{x}" for x in lay[6:])
    ),
)
def test_losses_depths_and_grads_match_single_process(mtp_parity, layout):
    base, refs, results = mtp_parity
    _check(_layout_config(base, layout), results[layout], refs[layout])
    for r in results[layout]:  # the converter names each chunk's params as the model does
        for built, named in r["names"] or ():
            assert built == named


def test_an_untied_embedding_copy_is_caught(distributed):
    """Planted: the embedding and the last stage's copy (pp2, MTP) keep their own grads: the
    first stage's table misses the MTP part of its gradient, the copy has only that."""
    base, data = _config(), _data(2)
    layout = (1, 2, None, False, False, "rope")
    ref = _reference(_layout_config(base, (1, 1, None, False, False, "rope")), data)
    per_rank = distributed.run(
        2, _all_layouts, base, [layout], {layout: ref[0]}, data, "untied-copy"
    )
    with pytest.raises(AssertionError, match="embedding"):
        _check(_layout_config(base, layout), [r[0] for r in per_rank], ref)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"mtp_num_layers": 0}, "mtp_num_layers"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -0.1}, "mtp_loss_scaling_factor"),
    ],
)
def test_bad_values_fail_naming_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        small_config(**overrides)


# ---- the roll under context parallelism -------------------------------------------------------


def _cp_rolls(seq: int):
    """Each cp size: this rank's roll of its load-balanced shard."""
    from pentatron.models.context_parallel import shard_for_cp_rank

    full = torch.arange(1, 2 * seq + 1).view(2, seq)  # [b, s], no zeros
    out = {}
    for cp in (2, 4):
        grid = initialize_model_parallel(ParallelConfig(cp=cp))  # dp = 4 / cp
        try:
            r = grid.rank("cp")
            out[cp] = (r, mtp.roll_left(shard_for_cp_rank(full, cp, r), grid.group("cp")))
        finally:
            destroy_model_parallel(grid)
    return out


def test_roll_left_under_cp_equals_the_full_roll_sharded(distributed):
    """cp2 and cp4: every chunk's last slot takes the next chunk's first element (held by
    another rank), the sequence's last slot is 0."""
    from pentatron.models.context_parallel import shard_for_cp_rank

    seq = 16
    full = torch.arange(1, 2 * seq + 1).view(2, seq)
    want = mtp.roll_left(full)
    assert want[:, -1].eq(0).all() and want[0, 0] == 2
    per_rank = distributed.run(4, _cp_rolls, seq)
    for cp in (2, 4):
        got = {res[cp][0]: res[cp][1] for res in per_rank if cp in res}
        assert sorted(got) == list(range(cp))
        for r, shard in got.items():
            assert torch.equal(shard, shard_for_cp_rank(want, cp, r)), (cp, r)
