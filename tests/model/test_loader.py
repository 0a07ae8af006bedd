"""The loader: every bad-checkpoint case names the file and the problem; sharded
checkpoints, dtypes and both config formats load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_config import ModelConfig, ModelLoadError
from tests.model.hf_utils import compare_prefill_then_decode, make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    make_checkpoint("llama-mha-untied", folder)
    return folder


@pytest.fixture
def copy(good, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _err(folder, **kw) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(folder, **kw)
    return str(e.value)


def test_missing_folder(tmp_path):
    msg = _err(tmp_path / "nope")
    assert "nope" in msg and "does not exist" in msg


def test_not_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a folder" in _err(f)


def test_missing_config(copy):
    (copy / "config.json").unlink()
    msg = _err(copy)
    assert "config.json" in msg and "not found" in msg


def test_invalid_config_json(copy):
    (copy / "config.json").write_text("{not json")
    msg = _err(copy)
    assert "config.json" in msg and "not valid JSON" in msg


def test_unsupported_architecture(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(cfg))
    msg = _err(copy)
    assert "config.json" in msg and "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg


def test_unsupported_rope_type(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (copy / "config.json").write_text(json.dumps(cfg))
    msg = _err(copy)
    assert "config.json" in msg and "yarn" in msg


def test_missing_weights(copy):
    (copy / "model.safetensors").unlink()
    msg = _err(copy)
    assert "no model.safetensors" in msg and str(copy) in msg


def test_only_pytorch_bin_weights(copy):
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    msg = _err(copy)
    assert "pytorch_model.bin" in msg and "convert to safetensors" in msg


def test_missing_tensor(copy):
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    msg = _err(copy)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "not found" in msg and "model.safetensors" in msg


def test_untied_without_lm_head(copy):
    tensors = load_file(copy / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert "'lm_head.weight' not found" in _err(copy)


def test_wrong_shape(copy):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    msg = _err(copy)
    assert "wrong shape" in msg and "model.layers.0.self_attn.o_proj.weight (64, 32)" in msg and "(64, 64)" in msg


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(copy, damage):
    path = copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x13\x37" * 64 if damage == "garbage" else data[: len(data) // 2])
    msg = _err(copy)
    assert "model.safetensors" in msg and "corrupt" in msg


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_checkpoint("llama-gqa-tied-llama3rope", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB", safe_serialization=True)
    shards = list((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = compare_prefill_then_decode(tmp_path / "sharded", hf, [[1, 2, 3, 4, 5], [7, 8]], block_size=4, decode_steps=3)
    assert a.ok, a.describe()


def test_sharded_missing_shard(tmp_path):
    hf = make_checkpoint("llama-mha-untied", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB", safe_serialization=True)
    victim = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = _err(tmp_path / "sharded")
    assert victim.name in msg and "missing" in msg


def test_sharded_tensor_not_in_listed_shard(tmp_path):
    hf = make_checkpoint("llama-mha-untied", tmp_path / "one")
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="20KB", safe_serialization=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.0.input_layernorm.weight"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    msg = _err(folder)
    assert name in msg and shard.name in msg


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.bfloat16])
def test_half_dtypes_load_and_run(good, dtype):
    loaded = load_model(good, dtype=dtype)
    assert all(p.dtype == loaded.dtype for p in loaded.model.parameters())
    assert loaded.dtype in (torch.bfloat16, torch.float16)


def test_bad_dtype(good):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(good, dtype="int8")


def test_cuda_unavailable_is_clear(good):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path is for machines without")
    assert "CUDA is not available" in _err(good, device="cuda")


def test_progress_bar_shown_when_asked(good, capsys):
    load_model(good, progress=True)
    assert "loading good" in capsys.readouterr().err


def test_old_config_format_rope_scaling():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 100,
            "intermediate_size": 128,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128009],
        }
    )
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.eos_token_ids == (128001, 128009) and cfg.head_dim == 16 and cfg.num_key_value_heads == 2


def test_missing_required_config_field():
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]})


def test_qwen2_sliding_window_layers():
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
        "sliding_window": 32,
    }
    assert ModelConfig.from_dict(base).sliding_window == (None,) * 4
    cfg = ModelConfig.from_dict({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert cfg.sliding_window == (None, None, 32, 32)
    assert cfg.qkv_bias and not cfg.o_bias
