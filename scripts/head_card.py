"""The model card a trained head ships with (``README.md`` beside its weights): what it is
for, the data, the recipe and the figures of the run that made it (``scripts/train_heads.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import head_prompts_wide as wide  # (scripts/ is on the path of every script that writes a card)


def write_card(folder: Path, kind: str, target: str, t: dict) -> None:
    """The head's model card: what it is for, the data, the recipe, the figures of its run."""
    data, vocab, recipe = t["data"], t["draft_vocab"], t["recipe"]
    layers = recipe.get("feature_layers") or ""
    fused = (
        f"; the target feature fuses the final state with the output streams of layers {layers} (EAGLE-3), which the "
        "target's forward pass hands over beside it"
        if layers
        else ""
    )
    what = (
        f"one decoder layer over [embedding of x_t; target feature f_{{t-1}}], its own KV cache{fused}"
        if kind == "eagle"
        else f"{recipe['num_heads']} residual blocks on the target's last hidden state, head i drafting i + 1 tokens ahead"
    )
    lines = [
        f"# {kind.upper()} draft head for {target}",
        "",
        f"A draft head that reads {target}'s final hidden states ({what}), sharing its embedding and LM head",
        f"restricted to a draft vocabulary of {vocab['size']} tokens. Load it with `--speculative-method {kind}`",
        "(found automatically for this target) or `--speculative-model <this folder>`; it is refused for any other",
        "target (`draftwise_head.json` holds the target's fingerprint). Output is exactly the target's: every draft",
        "is verified by exact rejection sampling.",
        "",
        "## Data",
        "",
        f"- {data['sequences']} training answers ({data['answer_tokens']} tokens), {data['held_out_sequences']} held out;",
        f"- source: {data['source']}: the target's own answers (self-distillation), greedy for 60% of prompts and",
        "  temperature 0.7 for the rest, with its final hidden state at every position;",
        f"- of these, {data.get('teacher_forced_sequences', 0)} answers ({data.get('teacher_forced_answer_tokens', 0)} tokens) are written",
        "  text the target read but did not write (`distill_heads_data.py --teacher-forced`: standard-library",
        "  source, module docstrings, installed packages' descriptions); the teacher is still the target's own",
        "  distribution at each position;",
        *(
            [
                f"- the streams of layers {layers}: every sequence re-read by the target, teacher-forced",
                "  (`scripts/layer_feats.py`; the recomputed final state within 0.03 of the stored one);",
            ]
            if layers
            else []
        ),
        "- prompts: Python standard-library functions (explain, write, test, review), instruction templates over",
        "  topics, arithmetic word problems; the evaluation prompts (bench/head_eval_prompts.py) are excluded;",
        f"- of the generated answers, {data.get('broad_sequences', 0)} ({data.get('broad_answer_tokens', 0)} tokens) answer the broad",
        "  families (`head_prompts.py --broad`, `distill_heads_data.py --prompts broad`): everyday advice and",
        "  explanations, short messages, code tasks in ten languages and programming questions, varied word problems",
        "  and logic;",
        *(
            [
                f"- and {data['wide_sequences']} ({data['wide_answer_tokens']} tokens) answer the wide families "
                "(`scripts/head_prompts_wide.py`,",
                f"  `distill_heads_data.py --prompts wide`): {sum(map(len, wide.SUBJECTS.values()))} subjects in "
                f"{len(wide.SUBJECTS)} domains ({', '.join(d.replace('_', ' and ') for d in wide.SUBJECTS)}) asked in {len(wide.ASKS)} ways,",
                f"  code tasks and programming concepts in {len(wide.LANGUAGES_WIDE)} languages, "
                f"{len(wide.REASONING_WIDE)} kinds of word problem; no wide prompt names",
                "  an evaluation prompt's subject, so the evaluation measures topics the head never saw;",
            ]
            if data.get("wide_sequences")
            else []
        ),
        (
            f"- draft vocabulary: the {vocab['size']} most frequent tokens of the generated answers, covering {vocab['answer_token_coverage']:.1%} of them."
            if not recipe.get("init") or recipe.get("new_vocab")
            else f"- draft vocabulary: the {vocab['size']} tokens of the head this run went on from (`{recipe['init']}`), "
            f"covering {vocab['answer_token_coverage']:.1%} of the generated answers."
        ),
        "",
        "## Recipe",
        "",
        "scripts/train_heads.py (see its docstring) with:",
        "",
        "```",
        json.dumps(recipe, indent=1),
        "```",
        "",
        f"{t['steps']} steps, {t['epochs']} epochs, {t['minutes']} minutes on {t['machine']}"
        + (
            f", going on from `{recipe['init']}` (its card: what it was trained on before)."
            if recipe.get("init")
            else "."
        ),
        "",
        "## Figures (held-out answers)",
        "",
        "Top-1 agreement: the head's first choice is the target's greedy token (over the target's whole",
        "vocabulary: a token outside the draft vocabulary is a miss), per drafted position, each given the earlier ones.",
        "",
        f"- top-1 agreement with the target per drafted position: {t['held_out_top1_per_position']}",
        f"- implied chain length at temperature 0 (tokens per target pass): {t['held_out_chain_length_t0']}",
        *(
            [
                f"- on the target's greedy answers to the {t['eval_prompts_answers']} evaluation prompts "
                "(bench/head_eval_prompts.py; never trained on): top-1 per drafted position "
                f"{t['eval_prompts_top1_per_position']}, implied chain length {t['eval_prompts_chain_length_t0']}",
            ]
            if "eval_prompts_top1_per_position" in t
            else []
        ),
        "",
        "Measured speedups and accepted lengths on the held-out evaluation prompts: docs/benchmarks.md.",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))
