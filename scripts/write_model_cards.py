"""Write the model cards (README.md) of the embedded default models from the numbers the
training run and the decode-step benchmark recorded:

    python scripts/train_default_models.py --out worker/default_models   # writes training_stats.json
    python bench/bench_decode_step.py                                       # writes bench/results/decode_step.json
    python scripts/write_model_cards.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "worker" / "default_models"


def greedy_sample(which: str, prompt: str = "def fibonacci(n):", n: int = 48) -> str:
    """What ``draftwise generate PROMPT --max-tokens N`` prints: the engine's greedy output
    (its stop set, its incremental detokenizer) after the prompt."""
    from draftwise.worker import LLM, SamplingParams, default_model_path

    llm = LLM(default_model_path(which), dtype="float32", max_num_seqs=1)
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return prompt + out.outputs[0].text


def card(which: str, s: dict, step: dict, cfg: dict) -> str:
    params = s[f"{which}_params"]
    other = "draft" if which == "target" else "target"
    role = (
        "the **target**: the model draftwise serves by default"
        if which == "target"
        else "the **draft**: a shallow model that proposes tokens for speculative decoding against the target"
    )
    tokens = s["batch"] * s["seq"]
    training = (
        f"Stage 1: {s['target_steps']} steps of batch {s['batch']} x {s['seq']} tokens "
        f"({s['target_steps'] * tokens / 1e6:.1f}M tokens) on all training files, AdamW (betas 0.9/0.95, weight decay 0.1), "
        f"peak learning rate 2e-3 with 100 warm-up steps and cosine decay to 10%, bf16 autocast; "
        f"{s['target_train_minutes']:.0f} minutes. Stage 2: {s['target2_steps']} steps "
        f"({s['target2_steps'] * tokens / 1e6:.1f}M tokens) on the library files only (no test suites: they are 60% of "
        f"the standard library and pull the model towards `assertEqual` lines), peak learning rate 1e-3; "
        f"{s['target2_train_minutes']:.0f} minutes"
        if which == "target"
        else f"distilled from the target: initialised from its embedding, first layer and final norm, then "
        f"{s['draft_steps']} steps of batch {s['batch']} x {s['seq']} tokens on 0.3 x cross-entropy + 0.7 x KL(target || draft), "
        f"same optimiser; {s['draft_train_minutes']:.0f} minutes"
    )
    ours = step.get(which, {}).get("ours_ms")
    hf = step.get(which, {}).get("hf_ms")
    cost = (
        f"{ours:.2f} ms on draftwise's runtime, {hf:.2f} ms on transformers (batch 1, float32, context {step['context']}; "
        f"`python bench/bench_decode_step.py` on {step['machine']})"
        if ours is not None
        else "not measured yet (`python bench/bench_decode_step.py`)"
    )
    ratio = ""
    if ours is not None:
        ratio = f"\n- Draft step / target step: **{step['draft_over_target_ours']:.3f}** on draftwise's runtime."
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, python, code, draftwise]
---

# draftwise default {which}

This is {role}. It is an ordinary Hugging Face `LlamaForCausalLM` checkpoint
(`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load it offline),
shipped inside the `draftwise` package so that the server has something real to serve with
no download. It shares its tokenizer with the {other}.

It is tiny: it writes Python-looking code, not correct programs. It exists to exercise and
measure the engine: batching, paged attention, speculative decoding.

## Shape

| | |
| --- | --- |
| parameters | {params / 1e6:.2f}M (tied input/output embeddings) |
| layers | {cfg["num_hidden_layers"]} |
| hidden / MLP width | {cfg["hidden_size"]} / {cfg["intermediate_size"]} |
| attention heads / key-value heads | {cfg["num_attention_heads"]} / {cfg["num_key_value_heads"]} (grouped-query), head size {cfg["head_dim"]} |
| context (`max_position_embeddings`) | {cfg["max_position_embeddings"]} (trained on {s["seq"]}-token windows; RoPE theta {cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))}) |
| vocabulary | {cfg["vocab_size"]}: byte-level BPE trained with `tokenizers` on the training files; `<pad>`=0, `<s>`=1 (prepended by the tokenizer), `</s>`=2 |
| weights | bfloat16 safetensors |

## Data

The Python standard library's own source: every `*.py` file under `sysconfig.get_paths()["stdlib"]`
(site-packages excluded) of Python {s["python"]}. A file is held out when
`crc32(relative path) % 25 == 0`: {s["train_files"]} training files ({s["train_tokens"] / 1e6:.2f}M tokens),
{s["heldout_files"]} held-out files ({s["val_tokens"] / 1e3:.0f}k tokens), listed in `docs/heldout_files.txt`.
Each file is one document: `<s> text </s>`; training windows are cut at random offsets of the concatenation.

## Training

{training}. Hardware: {s["threads"]} CPU threads ({s.get("cpu", "x86_64")}), torch {s["torch"]}.
Training time in all: {s["target_train_minutes"] + s["target2_train_minutes"] + s["draft_train_minutes"]:.0f} minutes
(the machine was shared with other work during the run, so this is an upper bound). Reproduce with
`python scripts/train_default_models.py --out worker/default_models`.

## Results

- Validation loss (cross-entropy, nats/token): **{s[f"{which}_val_loss"]:.3f}** on all held-out files,
  {s[f"{which}_val_loss_library"]:.3f} on the held-out library (non-test) files.
- Draft greedy acceptance rate against the target on held-out code: **{s["greedy_acceptance_rate"]:.3f}**
  (the share of positions where the draft's argmax equals the target's, along the target's own greedy
  continuations of {s["prompts"]} held-out snippets, {s["positions"]} positions); mean accepted tokens per
  round at k=4: {s["mean_accepted_per_round_k4"]:.2f}.
- One decode step: {cost}.{ratio}

## Sample

The greedy continuation (48 tokens) of `def fibonacci(n):`, as `draftwise generate` prints it:

```text
{greedy_sample(which)}
```

It is Python-shaped (an indented `return` statement that parses) and then repeats itself, as greedy
decoding of a model this small does; sampling (`temperature` 0.7-1.0, `repetition_penalty` 1.1)
reads better.
"""


def main() -> None:
    stats = json.loads((MODELS / "training_stats.json").read_text())
    step_path = ROOT / "bench" / "results" / "decode_step.json"
    step = json.loads(step_path.read_text()) if step_path.exists() else {}
    for which in ("target", "draft"):
        cfg = json.loads((MODELS / which / "config.json").read_text())
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        (MODELS / which / "README.md").write_text(card(which, stats, step, cfg))
        print(f"wrote {MODELS / which / 'README.md'}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    ).parse_args()  # --help prints this and exits; the script takes no options
    main()
