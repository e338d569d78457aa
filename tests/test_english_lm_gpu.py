"""What a GPU lease carries back: a checkpoint's weights as fp16 parts (a tensor split by rows where it is larger
than a part), with its config, state, vocabulary and sentencepiece model, put back together as a checkpoint."""

import json

import torch
from safetensors.torch import load_file, save_file

from benchmarks import english_lm_gpu


def test_weights_split_into_parts_come_back_as_the_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt-001-000000"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("ckpt-001-000000\n")
    weights = {"embedding.weight": torch.randn(100, 8), "lstm.bias": torch.randn(32), "head.weight": torch.randn(5, 8)}
    save_file(weights, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model": {"hidden_size": 8}}))
    (ckpt / "state.json").write_text(json.dumps({"tokens_seen": 7}))
    (ckpt / "vocab.tsv").write_text("<unk>\t0\n")
    (ckpt / "subword.model").write_bytes(b"pieces")
    monkeypatch.setattr(english_lm_gpu, "PART_BYTES", 1000)  # the 100 x 8 embedding (1,600 bytes) must split
    packed = tmp_path / "out"
    assert english_lm_gpu.pack_weights(tmp_path / "run", packed)["parts"] > 1
    assert all(p.stat().st_size < 2000 for p in packed.glob("model.part*.safetensors"))

    back = english_lm_gpu.unpack(packed, tmp_path / "back")
    restored = load_file(str(back / "model.safetensors"))
    for name, tensor in weights.items():
        assert restored[name].dtype == torch.float32
        assert torch.equal(restored[name], tensor.half().float())  # fp16 on the way: what the note says is lost
    assert json.loads((back / "state.json").read_text()) == {"tokens_seen": 7}
    assert (back / "subword.model").read_bytes() == b"pieces"
    assert (back.parent / "best").read_text().strip() == back.name
