"""Sharded load of a Hugging Face safetensors checkpoint at tp=2, pp=2 (world 4, gloo).

Each rank builds its chunk with `load_hf_checkpoint_shard` (reading only its slices), the
two stages run forward-only (stage 0 sends `[s, b, h]` to stage 1), and the last stage's
logits (all-gathered over tp) must equal the single-process `from_hf` model's, fp32,
atol=rtol=1e-5. `to_hf` on every rank, united over the stages, must equal the HF state
dict exactly. The checkpoint is saved in several files with an index, so the index path is
exercised; a tracing source proves no rank reads a tensor of another stage's layers.
"""

import pytest
import torch

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel

V = 100
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _save_llama(path, tied, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=V,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size="40KB")
    return model


def _ids():
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))


def _rank_forward(path, tp, pp):
    from pentatron.models.hf import load_hf_checkpoint_shard, safetensors_io, to_hf

    reads = []
    original = safetensors_io.SafetensorsDirSource.read

    def traced(self, name, dim=None, start=0, stop=None):
        reads.append(name)
        return original(self, name, dim, start, stop)

    safetensors_io.SafetensorsDirSource.read = traced
    try:
        grid = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp))
        model = load_hf_checkpoint_shard(path, grid).eval()
    finally:
        safetensors_io.SafetensorsDirSource.read = original
    ids = _ids()
    logits = None
    with torch.no_grad():
        if grid.is_first_stage():
            hidden = model(ids, None)
            comm.send(hidden.contiguous(), grid.next_pipeline_rank, group=grid.group("pp"))
        else:
            hidden = torch.empty(ids.size(1), ids.size(0), model.config.hidden_size)
            comm.recv(hidden, grid.prev_pipeline_rank, group=grid.group("pp"))
            model.set_input_tensor(hidden)
            logits = model(None, None, gather_logits=True)[..., :V]
    layers = sorted({int(n.split(".")[2]) for n in reads if n.startswith("model.layers.")})
    return {
        "logits": logits,
        "hf": to_hf(model),
        "hf_all": to_hf(model, gather_pipeline=True),
        "layers": layers,
        "pp_rank": grid.pp_rank,
    }


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_load_tp2_pp2_matches_single_process(distributed, tmp_path, tied):
    from pentatron.models.hf import from_hf, load_hf_checkpoint_shard

    hf = _save_llama(tmp_path, tied)
    ref_model = load_hf_checkpoint_shard(tmp_path).eval()  # single process, from the files
    with torch.no_grad():
        want = from_hf(hf).eval()(_ids(), None)[..., :V]
        torch.testing.assert_close(ref_model(_ids(), None)[..., :V], want, atol=0, rtol=0)
        torch.testing.assert_close(want, hf(_ids()).logits, atol=1e-4, rtol=1e-4)
    results = distributed.run(4, _rank_forward, str(tmp_path), 2, 2)
    for res in results:
        # Stage r reads only its two layers (plus embedding / norm / head, not listed).
        assert res["layers"] == ([0, 1] if res["pp_rank"] == 0 else [2, 3])
        if res["logits"] is not None:
            torch.testing.assert_close(res["logits"], want, **TOL)
    assert sum(r["logits"] is not None for r in results) == 2
    ref = hf.state_dict()
    merged = {}
    for res in results:
        for name, t in res["hf"].items():
            if name in merged:
                assert torch.equal(merged[name], t), name
            merged[name] = t
    assert set(merged) == set(ref)
    for name, t in ref.items():
        assert torch.equal(merged[name], t), name
    for res in results:  # gather_pipeline: the whole dict on every rank, bit for bit
        assert set(res["hf_all"]) == set(ref)
        for name, t in ref.items():
            assert torch.equal(res["hf_all"][name], t), name


def test_pipeline_gather_hands_collectives_device_tensors():
    """`to_hf(gather_pipeline=True)`'s broadcasts run on the grid's device, which under NCCL
    is the GPU: on the fake device (meta + torch's fake group, which rejects a host tensor
    as NCCL does) the gather raises nothing. It read a host tensor into its first broadcast
    before pentatron-models 0.5.3. (The fake device reads zeros, so only the header's
    broadcast runs here; the data's are bitwise-checked at gloo above.)"""
    from pentatron.models.hf.convert import _gather_pipeline
    from pentatron.parallel_state.testing.fake_device import FakeDevice, fake_world

    with fake_world(rank=0, world_size=2), FakeDevice():
        grid = initialize_model_parallel(ParallelConfig(pp=2))
        assert grid.device.type == "meta"
        _gather_pipeline({"w": torch.ones(3, device=grid.device)}, grid)
