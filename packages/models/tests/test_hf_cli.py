"""`pentatron-convert` round trip: HF -> Pentatron (tp=2, pp=2) -> HF reproduces every tensor
exactly, the result loads with `from_pretrained`, and each rank file is the state dict of
that rank's GPTModel (checked at tp=1 pp=1 against `from_hf`)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from pentatron.models.hf.cli import main

V = 100


def _llama(path, tied):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=V,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_cli_round_trip_tp2_pp2(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    hf = _llama(tmp_path / "hf", tied)
    ckpt, back = tmp_path / "pt", tmp_path / "back"
    assert (
        main(
            [
                "hf-to-pentatron",
                "--hf",
                str(tmp_path / "hf"),
                "--out",
                str(ckpt),
                "--tp",
                "2",
                "--pp",
                "2",
            ]
        )
        == 0
    )
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [
        "config.json",
        "tp00_pp000.safetensors",
        "tp00_pp001.safetensors",
        "tp01_pp000.safetensors",
        "tp01_pp001.safetensors",
    ]
    meta = json.loads((ckpt / "config.json").read_text())
    assert (meta["tp"], meta["pp"], meta["vocab_size"], meta["num_layers"]) == (2, 2, V, 4)
    assert main(["pentatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    again = transformers.LlamaForCausalLM.from_pretrained(back).eval()
    ref, got = hf.state_dict(), again.state_dict()
    assert set(ref) == set(got)
    for name, t in ref.items():
        assert torch.equal(got[name], t), name
    with pytest.raises(FileExistsError):
        main(["pentatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)])


def test_rank_file_is_the_model_state_dict(tmp_path):
    from pentatron.models.hf import from_hf

    hf = _llama(tmp_path / "hf", False)
    main(["hf-to-pentatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "pt")])
    sd = load_file(str(tmp_path / "pt" / "tp00_pp000.safetensors"))
    want = from_hf(hf).state_dict()
    assert set(sd) == set(want)
    for name, t in want.items():
        assert torch.equal(sd[name], t), name
