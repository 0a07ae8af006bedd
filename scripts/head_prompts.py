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


# ---- broad families (``broad_prompts``): everyday chat, code in several languages, varied
# reasoning; written for this set, none an evaluation prompt or a rewording of one ----

CHAT_ASKS = (
    "What are some practical tips for {a}?",
    "How can I get better at {a}?",
    "What should a beginner know before {a}?",
    "I want to try {a} this month. Can you make me a simple plan?",
    "What mistakes do people often make when {a}?",
    "My friend says {a} is a waste of time. How would you answer them?",
    "Can you give me a short checklist for {a}?",
    "How much time per week does {a} usually take to see progress?",
)
ACTIVITIES = (
    "learning a new language", "saving money", "running a first 5k", "cooking at home", "keeping a journal",
    "learning to draw", "studying for exams", "public speaking", "waking up earlier", "growing tomatoes",
    "learning the guitar", "reading more books", "decluttering a small flat", "writing a CV", "training a puppy",
    "drinking more water", "learning to swim", "taking better photos with a phone", "managing stress",
    "planning a birthday party", "making friends in a new city", "learning to type faster", "baking sourdough",
    "painting a room", "riding a bicycle in the city", "starting a podcast", "preparing for a job interview",
    "keeping houseplants alive", "learning chess openings", "travelling on a budget", "eating more vegetables",
)  # fmt: skip
EXPLAIN_ASKS = (
    "How does {x} work?",
    "Why does {x} happen?",
    "Can you explain {x} in simple terms?",
    "What is {x}, and why does it matter?",
    "Describe {x} in three short paragraphs.",
)
THINGS = (
    "a refrigerator", "a rainbow", "a microwave oven", "compound interest", "a credit score", "jet lag",
    "a hybrid car engine", "the seasons", "a thermostat", "GPS navigation", "inflation", "a heat pump",
    "muscle soreness after exercise", "thunder", "a vaccine trial", "noise-cancelling headphones", "yeast in bread",
    "the tides", "a password manager", "an electric kettle", "a QR code", "static electricity", "a sunset's colours",
    "a mortgage", "the greenhouse effect", "a touch screen", "echoes", "a library's catalogue", "a barcode",
)  # fmt: skip
DIFF_PAIRS = (
    ("a virus", "a bacterium"), ("a lake", "a pond"), ("baking soda", "baking powder"), ("RAM", "storage"),
    ("a crocodile", "an alligator"), ("speed", "velocity"), ("a simile", "a metaphor"), ("an LED", "a light bulb"),
    ("a debit card", "a credit card"), ("a moth", "a butterfly"), ("a tornado", "a hurricane"),
    ("a resume", "a cover letter"), ("a fruit", "a vegetable"), ("latitude", "longitude"), ("a star", "a planet"),
)  # fmt: skip
NOTES = (
    "Write a short message to {p} {o}.",
    "Write a friendly note to {p} {o}. Keep it under 80 words.",
    "Draft a polite email to {p} {o}.",
)
PEOPLE = ("my landlord", "a colleague", "my teacher", "my grandmother", "a new team member", "my manager", "a client")
OCCASIONS = (
    "to say thank you for their help last week", "to ask to move our meeting to Friday", "to congratulate them on a new job",
    "to apologise for missing a call", "to invite them to a small dinner", "to report a broken heater",
    "to ask for feedback on a report", "to wish them a quick recovery",
)  # fmt: skip

LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby", "Bash")
CODE_TASKS = (
    "counts the words in a sentence", "returns the largest number in a list", "reverses the words of a sentence",
    "converts a temperature from Celsius to Fahrenheit", "checks whether a number is prime",
    "returns the factorial of n", "counts how many times each character appears in a string",
    "flattens a nested list", "computes the average of a list of numbers", "finds the second largest number in a list",
    "capitalizes the first letter of every word", "checks whether two strings are anagrams",
    "returns the greatest common divisor of two integers", "sums the digits of an integer",
    "rotates a list by k positions", "finds the most common element in a list", "converts a binary string to an integer",
    "splits a list into chunks of size n", "validates that a string looks like an email address",
    "returns the intersection of two lists", "computes the n-th triangular number", "removes all vowels from a string",
    "checks whether a year is a leap year", "returns the indexes of two numbers that add up to a target",
    "implements binary search on a sorted list", "transposes a matrix", "counts the lines in a text file",
)  # fmt: skip
CODE_FORMS = (
    "Write a {lang} function that {task}.",
    "In {lang}, how would I write a function that {task}? Include a short example call.",
    "Show me a {lang} program that {task}, and explain it briefly.",
)
CODE_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?",
    "Explain what a closure is in JavaScript, with an example.",
    "What does the `async` keyword do in Python?",
    "How do I sort a dictionary by its values in Python?",
    "What is a race condition, and how can I avoid one?",
    "Explain recursion with a simple example.",
    "What is the difference between `==` and `is` in Python?",
    "How do I handle exceptions in Java?",
    "What is Big O notation? Give two examples.",
    "How do I create a virtual environment in Python?",
    "Write a SQL query that counts the orders placed in each month.",
    "Write a SQL query that lists products that were never ordered.",
    "Explain what a primary key is in a database.",
    "What does `git rebase` do, compared with `git merge`?",
    "How do I write a unit test in JavaScript with Jest?",
    "Explain the difference between a process and a thread.",
    "What is a REST API? Give an example request.",
    "How do I read a JSON file in Python?",
    "Write a regular expression that matches a US ZIP code, and explain it.",
    "How do I reverse a linked list? Show code in Python.",
)
REASONING_ASKS = (
    "A cyclist rides {a} kilometres in {c} hours. How far does she ride in {d} hours at the same pace? Explain.",
    "A jacket costs {a} dollars and is on sale for {p} percent off. What is the sale price? Work it out step by step.",
    "Lena is {c} years older than her brother, who is {b}. How old will Lena be in {d} years? Explain your reasoning.",
    "A recipe needs {c} eggs for {d} people. How many eggs are needed for {e} people? Show your work.",
    "A tank holds {a} litres and drains {b} litres per minute. How long until it is empty? Explain.",
    "There are {a} marbles shared equally among {c} children. How many does each get, and how many are left over?",
    "A square garden has a side of {c} metres. What are its area and perimeter? Show the steps.",
    "If a meeting starts at {h}:15 and lasts {b} minutes, when does it end? Explain.",
    "Which is larger, {c}/{e} or {d}/{f}? Explain how you compare them.",
    "A phone plan costs {b} dollars a month plus {c} dollars per gigabyte. What does a month with {d} gigabytes cost?",
    "If it is {w} today, what day will it be in {a} days? Show how you work it out.",
    "Three friends split a bill of {a} dollars, and one pays {b} dollars more than the others. How much does each pay?",
    "What is {p} percent of {a}? Explain the method.",
    "A train leaves at {h}:40 and arrives {a} minutes later. What time does it arrive? Think it through.",
    "All cats in the shelter are vaccinated. Milo is a cat in the shelter. What can we conclude? Explain.",
    "If some birds cannot fly, and penguins are birds, can we conclude that penguins cannot fly? Explain.",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def broad_prompts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` (kind, prompt) pairs from the broad families: about 35% chat (advice,
    explanations, differences, short messages), 35% code (tasks in ``LANGUAGES``, programming
    questions), 30% reasoning (word problems, logic); shuffled, distinct, none equal to or
    containing an evaluation prompt (or contained in one)."""
    rng = random.Random(seed + 7919)
    chat: set[str] = set()
    code: set[str] = set(CODE_QUESTIONS)
    reasoning: set[str] = set()
    n_chat, n_code = int(count * 0.35), int(count * 0.35)
    chat_kinds = len(CHAT_ASKS) * len(ACTIVITIES) + len(EXPLAIN_ASKS) * len(THINGS) + len(DIFF_PAIRS)
    chat_kinds += len(NOTES) * len(PEOPLE) * len(OCCASIONS)
    if n_chat > chat_kinds or n_code > len(CODE_QUESTIONS) + len(CODE_FORMS) * len(LANGUAGES) * len(CODE_TASKS):
        raise ValueError(f"{count} broad prompts asked: more than the chat or code families can make")
    while len(chat) < n_chat:
        r = rng.random()
        if r < 0.4:
            chat.add(rng.choice(CHAT_ASKS).format(a=rng.choice(ACTIVITIES)))
        elif r < 0.7:
            chat.add(rng.choice(EXPLAIN_ASKS).format(x=rng.choice(THINGS)))
        elif r < 0.85:
            x, y = rng.choice(DIFF_PAIRS)
            chat.add(f"What is the difference between {x} and {y}?")
        else:
            chat.add(rng.choice(NOTES).format(p=rng.choice(PEOPLE), o=rng.choice(OCCASIONS)))
    while len(code) < n_code:
        code.add(rng.choice(CODE_FORMS).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS)))
    while len(reasoning) < count - n_chat - n_code:
        a, b, c = rng.randint(20, 480), rng.randint(2, 40), rng.randint(2, 12)
        d, e, f = rng.randint(2, 15), rng.randint(3, 16), rng.randint(3, 16)
        reasoning.add(
            rng.choice(REASONING_ASKS).format(
                a=a, b=b, c=c, d=d, e=e, f=f, p=rng.choice((5, 10, 15, 20, 25, 30, 40, 75)),
                h=rng.randint(1, 11), w=rng.choice(WEEKDAYS),
            )
        )  # fmt: skip
    held_out = [p for _, p in EVAL_PROMPTS]
    pairs = [("chat", p) for p in sorted(chat)] + [("code", p) for p in sorted(code)]
    pairs += [("reasoning", p) for p in sorted(reasoning)]
    pairs = [(k, p) for k, p in pairs if not any(e in p or p in e for e in held_out)]
    rng.shuffle(pairs)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--broad", action="store_true", help="the broad families (broad_prompts) instead")
    args = ap.parse_args()
    make = broad_prompts if args.broad else training_prompts
    for kind, prompt in make(args.count, args.seed):
        print(json.dumps({"kind": kind, "prompt": prompt}))


if __name__ == "__main__":
    main()
