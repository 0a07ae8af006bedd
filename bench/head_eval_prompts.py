"""Held-out evaluation prompts for the trained draft heads (EAGLE, Medusa).

Written by hand for evaluation only: the training prompt set (``scripts/head_prompts.py``)
is built from other sources (standard-library functions of modules listed there, and
instruction templates over topics) and drops any prompt that equals or contains one of
these; ``tests/tooling/test_head_prompts.py`` checks that no evaluation prompt reaches
training. Three kinds, as the issue asks: chat, code, reasoning-style.
"""

from __future__ import annotations

CHAT = [
    "What are some good ways to stay focused while working from home?",
    "Can you explain why the sky looks blue during the day?",
    "I am planning a trip to Japan in spring. What should I pack?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "What is the difference between weather and climate?",
    "Give me a simple recipe for pancakes.",
    "How do vaccines help the body fight disease?",
    "Suggest a name for a small coffee shop near a library, and explain your choice.",
]

CODE = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "How do I read a CSV file in Python and print each row?",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a list comprehension is in Python, with an example.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
]

REASONING = [
    "A train travels 60 miles in 1.5 hours. What is its average speed? Explain step by step.",
    "If I have 3 apples and buy 5 more, then give away 2, how many apples do I have? Think step by step.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain.",
    "A shop sells pens at 2 dollars each. How much do 7 pens cost? Show your reasoning.",
    "Tom is older than Anna. Anna is older than Ben. Who is the youngest? Explain.",
    "What is 15 percent of 80? Explain how you got the answer.",
    "A rectangle is 4 meters wide and 9 meters long. What is its area and its perimeter?",
    "If today is Monday, what day of the week will it be in 10 days? Explain step by step.",
]

ALL = [("chat", p) for p in CHAT] + [("code", p) for p in CODE] + [("reasoning", p) for p in REASONING]
"""(kind, prompt) pairs, in a fixed order."""

__all__ = ["ALL", "CHAT", "CODE", "REASONING"]
