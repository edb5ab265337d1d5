"""Benchmark prompt sets, kept out of every drafter's training data (`--exclude-file`, written by
`python benchmarks/bench_prompts.py --exclude-file FILE`).

`code`: the 16 short Python-function prompts of runs 1-29 (all of one kind, like much of the synthetic
training pool). `varied`: what a chat server sees: code to write and code to complete, explanations, general
chat, multi-turn conversations, and prompts from a few words to a paragraph. `unfamiliar`: other languages,
copied random data, long numbers, made-up tables (a stress test of the speed-up away from the drafter's
training pool). `long`: a question about pasted material (a log, a CSV table, a module, a transcript) of
700-2,400 tokens (`long_prompts.py`), where a tree's attention costs most. A conversation is a list of
messages, the last one the user's; a plain string is one user message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # long_prompts, when imported from elsewhere
from long_prompts import LONG  # noqa: E402

Conversation = str | list[dict[str, str]]

CODE = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses a linked list.",
    "Write a Python class for a queue with enqueue and dequeue.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that counts the words in a file.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the median of a list of numbers.",
    "Write a Python function that converts a string to title case without str.title.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a Python function that counts how many times each character appears in a string.",
    "Write a Python function that checks whether a number is a perfect square.",
    "Write a Python function that returns the n-th row of Pascal's triangle.",
    "Write a Python function that removes all whitespace from a string.",
]

VARIED: list[Conversation] = [
    # code to write, in several languages
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    # code to complete or fix
    "Complete this Python function:\n\ndef binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "This Python code raises a KeyError. Why, and how do I fix it?\n\n"
    "counts = {}\nfor word in text.split():\n    counts[word] += 1\n",
    "Add type hints and a docstring to this function:\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0\n",
    # explanations
    "Explain what a race condition is, with an everyday example.",
    "How does public-key cryptography let two strangers agree on a secret?",
    "Why is the sky blue but sunsets red?",
    "What is the difference between a process and a thread?",
    "Explain compound interest to a teenager who just got a first job.",
    # general chat
    "hi! any tips for staying focused while working from home?",
    "Suggest a name for a small bakery that specialises in sourdough.",
    "I have eggs, spinach, feta and half an onion. What can I cook tonight?",
    "Write a short, friendly message declining a wedding invitation.",
    "What are three good habits for learning a new language as an adult?",
    "Give me a two-day itinerary for a first visit to Lisbon.",
    # longer prompts
    "I am preparing a talk for my team about why we should write tests before fixing bugs. The audience is "
    "five developers who mostly work on a legacy codebase without many tests, and they are sceptical "
    "because deadlines are tight. Give me an outline of the talk with the main arguments, one concrete "
    "example, and how to answer the objection that it slows us down.",
    "Summarise the following paragraph in two sentences: The printing press, developed by Johannes "
    "Gutenberg around 1440, made books far cheaper to produce. Before it, texts were copied by hand, which "
    "took months and kept literacy the privilege of a few. Within decades, presses spread across Europe, "
    "pamphlets and books circulated widely, and ideas, from scientific findings to religious reform, "
    "travelled faster than ever before.",
    # multi-turn
    [
        {"role": "user", "content": "What is a good first programming language?"},
        {
            "role": "assistant",
            "content": "Python is a common choice: its syntax is readable and it is used in many fields.",
        },
        {"role": "user", "content": "Okay. What should I build first to practise it?"},
    ],
    [
        {"role": "user", "content": "Can you help me plan a vegetable garden?"},
        {"role": "assistant", "content": "Of course. How much space do you have, and how sunny is it?"},
        {"role": "user", "content": "About four square metres, with sun most of the afternoon."},
    ],
    [
        {"role": "user", "content": "Write a Python function that returns the largest number in a list."},
        {"role": "assistant", "content": "def largest(xs):\n    return max(xs)"},
        {"role": "user", "content": "Now do it without using max, and handle an empty list."},
    ],
    [
        {"role": "user", "content": "I keep forgetting people's names right after meeting them."},
        {"role": "assistant", "content": "That is very common. Do you want some memory techniques?"},
        {"role": "user", "content": "Yes please, simple ones."},
    ],
    "Translate into French: 'The meeting has been moved to Thursday afternoon.'",
]

# Requests unlike anything a drafter trained on chat and code answers has seen (other languages, copied
# random data, long numbers): a stress test of the claim that DART never runs slower than plain decoding
# whatever its acceptance, not a measure of its speed-up.
UNFAMILIAR: list[Conversation] = [
    "Traduis en français : « The committee postponed the vote until the budget figures were checked. »",
    "Schreibe drei kurze Sätze auf Deutsch über einen verregneten Sonntag im Herbst.",
    "Escribe una receta corta de tortilla de patatas, en español, con los pasos numerados.",
    "Repeat the following string exactly, then reverse it: qZ7vKp2LmX9wRt4bNc8Hj",
    "Multiply 48213 by 7719 and show each partial product.",
    "Convert these temperatures from Celsius to Fahrenheit: -40, 12.5, 37, 101.3, 3.14159.",
    "Sort these words alphabetically: zephyr, quill, anchor, marmalade, kettle, obsidian, blizzard, fjord.",
    "Write the first 25 rows of a CSV file with columns id,sku,price,qty using made-up values.",
    "Spell out the number 7,403,918,256 in English words.",
    "Give the ROT13 encoding of: Meet me at the old lighthouse at dawn.",
    "List the chemical symbols and atomic numbers of the elements from hydrogen to calcium.",
    "Write a limerick in which every line ends with a word that rhymes with 'orange'.",
    "Count down from 60 to 1 by threes, separated by semicolons.",
    "Write a short dialogue in Italian between a barista and a customer ordering breakfast.",
    "Write a JSON array of 12 objects describing fictional moons, each with name, radius_km and albedo.",
    "Explain the Japanese phrase 一期一会 and give two example sentences with romaji.",
]

WARMUP: list[Conversation] = [
    "Write a haiku about autumn.",
    "Explain recursion to a child.",
    "List three uses of a hash map.",
    "Describe the water cycle briefly.",
]

SETS: dict[str, list[Conversation]] = {"code": CODE, "varied": VARIED, "unfamiliar": UNFAMILIAR, "long": LONG}


def messages(conversation: Conversation) -> list[dict[str, str]]:
    if isinstance(conversation, str):
        return [{"role": "user", "content": conversation}]
    return conversation


def user_turns() -> list[str]:
    """Every user message of every set, one per benchmark prompt the training data must not contain."""
    turns = []
    for conversations in (*SETS.values(), WARMUP):
        for conversation in conversations:
            turns.extend(m["content"] for m in messages(conversation) if m["role"] == "user")
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exclude-file", type=Path, required=True, help="write the prompts here, one a line")
    args = parser.parse_args()
    # One line each, as `sglang_dart.train.generate --exclude-file` reads them (newlines escaped).
    lines = [turn.replace("\n", "\\n") for turn in user_turns()]
    args.exclude_file.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} benchmark prompts to {args.exclude_file}")


if __name__ == "__main__":
    main()
