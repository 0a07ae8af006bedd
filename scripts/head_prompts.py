"""The training prompt set for the draft heads (EAGLE, Medusa): built offline, from what
installs here, reproducibly (a fixed seed).

Three sources, mixed:

- **code**: functions of the Python standard library modules in ``CODE_MODULES`` (their
  source, ≤ ``MAX_SOURCE_LINES`` lines, and the first sentence of their docstring) turned into
  chat requests: explain this function, write a function that does what the docstring says,
  write tests for it, review it;
- **instructions**: ``TEMPLATES`` (written for this set) over ``TOPICS``;
- **arithmetic**: word problems with random numbers, answered step by step.

Every prompt of the held-out evaluation set (``bench/head_eval_prompts.py``) is dropped, as
is any prompt containing one: evaluation never sees a training prompt.

    python scripts/head_prompts.py --count 1200 > prompts.jsonl   # {"kind", "prompt"} per line
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from head_eval_prompts import ALL as EVAL_PROMPTS  # noqa: E402

CODE_MODULES = (
    "textwrap", "json.encoder", "csv", "string", "statistics", "heapq", "bisect", "fractions", "functools",
    "shlex", "difflib", "calendar", "colorsys", "glob", "fnmatch", "posixpath", "urllib.parse", "html",
    "base64", "gzip", "zipfile", "configparser", "argparse", "pprint", "reprlib", "dataclasses",
    "collections", "random", "secrets", "uuid", "ipaddress", "email.utils", "mimetypes", "sched", "queue",
    "contextlib", "copy", "shutil", "tempfile", "filecmp", "inspect", "ast", "tokenize", "typing",
    "traceback", "warnings", "timeit", "optparse", "getopt", "locale", "gettext", "operator", "enum",
    "weakref", "graphlib", "zipimport", "netrc", "plistlib", "quopri", "wave", "smtplib", "ftplib",
    "http.cookiejar", "logging", "subprocess", "selectors", "codecs", "pathlib", "os",
)  # fmt: skip
MAX_SOURCE_LINES = 24

CODE_ASKS = (
    "Explain what this Python function does, step by step.\n\n```python\n{src}\n```",
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Write a few unit tests with pytest for this function.\n\n```python\n{src}\n```",
    "Review this Python code and suggest improvements.\n\n```python\n{src}\n```",
    "What does `{name}` in the Python module `{module}` do? Give a short example of using it.",
    "Rewrite this function in a simpler way, keeping its behaviour.\n\n```python\n{src}\n```",
)

TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "List five questions a student might ask about {t}, and answer the first one.",
    "How would you describe {t} to someone who has never heard of it?",
    "Write a short story in which {t} plays an important role.",
    "What are common misconceptions about {t}?",
    "Write an email to a friend recommending they learn about {t}.",
    "Compare {t} with {u}.",
    "Why do people care about {t}?",
    "Give a step-by-step guide for a beginner interested in {t}.",
    "Write a tweet about {t}.",
    "What would a world without {t} look like?",
)

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the Roman Empire", "chess", "jazz music",
    "electric cars", "recycling", "the human heart", "bees", "the internet", "solar panels", "democracy",
    "the French Revolution", "machine learning", "gardening", "the moon landing", "dinosaurs", "coral reefs",
    "meditation", "the printing press", "earthquakes", "bread baking", "public libraries", "marathon running",
    "the Great Wall of China", "rainforests", "cryptography", "the piano", "honey", "tides", "trains",
    "the Olympic Games", "cloud computing", "penguins", "origami", "the periodic table", "coffee",
    "mountain climbing", "the immune system", "wind energy", "ancient Egypt", "renewable energy",
    "open source software", "birdwatching", "the stock market", "volunteering", "recycled paper",
    "time zones", "the metric system", "camping", "video games", "sleep", "friendship", "bicycles",
    "lighthouses", "glaciers", "chocolate", "the theory of evolution", "spreadsheets", "podcasts",
)  # fmt: skip

ARITHMETIC = (
    "A farmer has {a} cows and buys {b} more. Then {c} cows are sold. How many cows are left? Answer step by step.",
    "A book has {a} pages. Maria reads {b} pages a day. How many days does she need to finish it?",
    "What is {a} times {b}, minus {c}? Show each step.",
    "A box holds {b} oranges. How many boxes are needed for {a} oranges?",
    "Sam saves {b} dollars a week. How much has he saved after {c} weeks?",
    "A class has {a} students and {b} of them are absent. What fraction of the class is present?",
    "Is {a} a prime number? Explain how you check.",
    "A bus leaves at {h}:00 and the trip takes {c} hours. When does it arrive?",
)


def _first_sentence(doc: str) -> str:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    return line.split(". ")[0].rstrip(".") + "."


def code_prompts(rng: random.Random) -> list[str]:
    out = []
    for modname in CODE_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name, fn in sorted(inspect.getmembers(mod, inspect.isfunction)):
            if name.startswith("_") or getattr(fn, "__module__", None) != mod.__name__ or not fn.__doc__:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(fn))
                sig = str(inspect.signature(fn))
            except (OSError, TypeError, ValueError):
                continue
            if len(src.splitlines()) > MAX_SOURCE_LINES:
                continue
            for ask in rng.sample(CODE_ASKS, 2):  # two different requests about each function
                out.append(
                    ask.format(src=src.rstrip(), name=name, sig=sig, doc=_first_sentence(fn.__doc__), module=modname)
                )
    return out


def instruction_prompts(rng: random.Random, n: int) -> list[str]:
    out = set()
    while len(out) < n:
        t, u = rng.sample(TOPICS, 2)
        out.add(rng.choice(TEMPLATES).format(t=t, u=u))
    return sorted(out)


def arithmetic_prompts(rng: random.Random, n: int) -> list[str]:
    out = set()
    while len(out) < n:
        a, b, c = rng.randint(12, 400), rng.randint(2, 30), rng.randint(2, 11)
        out.add(rng.choice(ARITHMETIC).format(a=a, b=b, c=c, h=rng.randint(1, 12)))
    return sorted(out)


TEXT_ASKS = {
    "code": "Write a Python function `{name}{sig}` that does the following: {doc}",
    "module": "Explain what the Python module `{name}` is for and how to use it.",
    "package": "What is the Python package `{name}`, and how do I use it?",
}
MAX_ANSWER_CHARS = 2400


def text_answers(seed: int = 0) -> list[tuple[str, str, str]]:
    """(kind, prompt, answer) triples whose answers are written text that installs here, for
    teacher-forced head data (``distill_heads_data.py --teacher-forced``): the source of
    standard-library functions (≤ 3 x ``MAX_SOURCE_LINES`` lines) as the answer to "write a
    function that ...", module docstrings as the answer to "explain module X", and installed
    packages' descriptions (their README) as the answer to "what is package X"; shuffled,
    answers cut at ``MAX_ANSWER_CHARS``; none containing an evaluation prompt."""
    import importlib.metadata
    import pkgutil

    rng = random.Random(seed)
    out: list[tuple[str, str, str]] = []
    modules = sorted(set(CODE_MODULES) | {m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names})
    for modname in modules:
        if modname.startswith("_") or modname in ("this", "antigravity", "idlelib", "tkinter", "turtle"):
            continue
        try:
            mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - any module that does not import here is skipped
            continue
        if mod.__doc__ and len(mod.__doc__) > 300:
            out.append(("module", TEXT_ASKS["module"].format(name=modname), mod.__doc__.strip()))
        for name, fn in sorted(inspect.getmembers(mod, inspect.isfunction)):
            if name.startswith("_") or getattr(fn, "__module__", None) != mod.__name__ or not fn.__doc__:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(fn)).rstrip()
                sig = str(inspect.signature(fn))
            except (OSError, TypeError, ValueError):
                continue
            if len(src.splitlines()) > 3 * MAX_SOURCE_LINES:
                continue
            ask = TEXT_ASKS["code"].format(name=name, sig=sig, doc=_first_sentence(fn.__doc__))
            out.append(("code", ask, f"Here is the function:\n\n```python\n{src}\n```"))
    seen = set()
    for dist in importlib.metadata.distributions():
        name, desc = dist.metadata.get("Name"), dist.metadata.get_payload() or dist.metadata.get("Description")  # type: ignore[attr-defined]
        if not name or name.lower() in seen or not desc or len(desc) < 400:
            continue
        seen.add(name.lower())
        out.append(("package", TEXT_ASKS["package"].format(name=name), desc.strip()))
    held_out = [p for _, p in EVAL_PROMPTS]
    out = [(k, p, a[:MAX_ANSWER_CHARS]) for k, p, a in out if not any(e in p or e in a for e in held_out)]
    rng.shuffle(out)
    return out


def training_prompts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` (kind, prompt) pairs: about 45% code, 40% instructions, 15% arithmetic,
    shuffled; none equal to, or containing, an evaluation prompt."""
    rng = random.Random(seed)
    code = code_prompts(rng)
    rng.shuffle(code)
    code = code[: int(count * 0.45)]
    arith = arithmetic_prompts(rng, int(count * 0.15))
    instr = instruction_prompts(rng, count - len(code) - len(arith))
    held_out = [p for _, p in EVAL_PROMPTS]
    pairs = [("code", p) for p in code] + [("instruction", p) for p in instr] + [("arithmetic", p) for p in arith]
    pairs = [(k, p) for k, p in pairs if not any(e in p or p in e for e in held_out)]
    rng.shuffle(pairs)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for kind, prompt in training_prompts(args.count, args.seed):
        print(json.dumps({"kind": kind, "prompt": prompt}))


if __name__ == "__main__":
    main()
