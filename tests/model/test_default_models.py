"""The embedded default models: what ships, that transformers loads them offline, and that
our runtime computes what transformers computes on them."""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftwise.worker import LLM, SamplingParams, default_model_path
from draftwise.worker.model.loader import load_model
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.model.hf_utils import compare_prefill_then_decode

FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
]
WHICH = ["target", "draft"]


@pytest.fixture(scope="module")
def hf_models():
    from transformers import AutoModelForCausalLM

    return {
        w: AutoModelForCausalLM.from_pretrained(
            default_model_path(w), dtype=torch.float32, local_files_only=True
        ).eval()
        for w in WHICH
    }


@pytest.mark.parametrize("which", WHICH)
def test_checkpoint_files(which):
    folder = default_model_path(which)
    for f in FILES:
        assert (folder / f).is_file(), f"{folder / f} missing"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        dtypes = {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
    assert dtypes <= {"BF16", "F16"}, dtypes
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 2048
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_sizes():
    total = sum((default_model_path(w) / "model.safetensors").stat().st_size for w in WHICH)
    assert total < 40 * 1024 * 1024, f"shipped weights are {total / 2**20:.1f} MiB"
    target, draft = (load_model(default_model_path(w)) for w in WHICH)
    n_target = sum(p.numel() for p in target.model.parameters())
    n_draft = sum(p.numel() for p in draft.model.parameters())
    assert 8e6 <= n_target <= 15e6 and 1e6 <= n_draft <= 3e6, (n_target, n_draft)
    assert target.config.num_hidden_layers >= 8 and draft.config.num_hidden_layers <= 2
    assert target.config.vocab_size == draft.config.vocab_size


def test_tokenizers_identical_and_load_offline():
    from transformers import AutoTokenizer

    texts = ["def fibonacci(n):\n    return n", "# 中文注释 😀\nx = {'a': 1}\n"]
    toks = [AutoTokenizer.from_pretrained(default_model_path(w), local_files_only=True) for w in WHICH]
    assert 7000 <= len(toks[0]) <= 9000
    for t in texts:
        ids = toks[0].encode(t)
        assert ids == toks[1].encode(t) and ids[0] == toks[0].bos_token_id
        assert toks[0].decode(ids, skip_special_tokens=True) == t


def _heldout_prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = (Path(__file__).parents[2] / "docs" / "heldout_files.txt").read_text().split()
    rng = random.Random(seed)
    out = []
    for name in rng.sample(names, len(names)):
        path = root / name
        if path.is_file() and path.stat().st_size > 2000:
            ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
            out.append(ids[: rng.randrange(1, length)])
        if len(out) == n:
            return out
    raise AssertionError("not enough held-out files on this machine")


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("which", WHICH)
def test_shipped_models_match_hf(hf_models, which, block_size):
    tok = load_tokenizer(default_model_path(which))
    prompts = _heldout_prompts(tok, n=5, length=80, seed=block_size)
    a = compare_prefill_then_decode(default_model_path(which), hf_models[which], prompts, block_size, decode_steps=20)
    assert a.ok, f"{which} block_size={block_size}: {a.describe()}"


def test_fibonacci_greedy_matches_hf_and_reads_as_python(hf_models):
    """The engine's greedy tokens are transformers' greedy tokens, and what ``draftwise generate``
    prints (the engine's stop set and incremental detokenizer) is the model card's sample."""
    folder = default_model_path("target")
    tok = load_tokenizer(folder)
    prompt = "def fibonacci(n):"
    ids = tok.encode(prompt)
    llm = LLM(folder, dtype="float32", max_num_seqs=1)
    # no stop on either side: 48 tokens each
    (free,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    ours = free.outputs[0].token_ids
    hf = hf_models["target"].generate(
        torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert free.prompt_token_ids == ids and len(ours) == 48
    assert ours == hf[0, len(ids) :].tolist()
    assert free.outputs[0].text == tok.decode(ours)  # the incremental detokenizer adds up to the whole
    # as `draftwise generate PROMPT --max-tokens 48` prints it: up to the engine's stop set
    (shown,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert ours[: len(shown.outputs[0].token_ids)] == shown.outputs[0].token_ids
    text = prompt + shown.outputs[0].text
    # the function: the prompt line and its indented body, up to the first line back at column 0
    lines = text.split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line and not line[0].isspace():
            break
        body.append(line)
    src = "\n".join(body).rstrip()
    assert len(src.split("\n")) >= 2, text  # the def line and at least one body line
    # the last line may be cut mid-statement by max_new_tokens: drop it if needed
    try:
        ast.parse(src)
    except SyntaxError:
        ast.parse("\n".join(src.split("\n")[:-1]))
    assert "return" in src or "yield" in src, text
    # the model card shows exactly this sample
    card = (folder / "README.md").read_text()
    assert f"```text\n{text}\n```" in card, (
        "the model card's sample is stale: python scripts/write_model_cards.py"
    )  # text: a formatter must not re-indent model output
