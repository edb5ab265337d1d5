"""Synthetic chat prompts (code and general questions) for regenerating training data with the target.

There is no dataset on this machine, so prompts are composed from short task and topic lists. Drafters are
trained on the target's own answers (the EAGLE/DART recipe of regenerating responses), so the prompts only
need to cover the kind of conversation the drafter will serve.
"""

from __future__ import annotations

import random

_CODE_TASKS = [
    "returns the largest element of a list",
    "sums the even numbers in a list",
    "removes duplicates from a list while keeping order",
    "counts the vowels in a string",
    "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers",
    "checks whether two strings are anagrams",
    "returns the n-th triangular number",
    "sorts a list of tuples by their second element",
    "reads a CSV file and returns its rows",
    "finds the most common word in a text",
    "capitalizes the first letter of every word",
    "computes the average of a list of numbers",
    "checks whether a year is a leap year",
    "returns the binary representation of an integer",
    "merges two dictionaries",
    "finds the second smallest number in a list",
    "rotates a list by k positions",
    "implements binary search",
    "implements bubble sort",
    "implements insertion sort",
    "implements quicksort",
    "computes the power set of a list",
    "transposes a matrix",
    "multiplies two matrices",
    "validates an email address with a regular expression",
    "counts the lines in a text file",
    "returns the digits of a number as a list",
    "checks whether a list is sorted",
    "finds the intersection of two lists",
    "computes the running total of a list",
    "splits a list into chunks of size n",
    "returns the length of the longest word in a sentence",
    "converts a Roman numeral to an integer",
    "checks whether parentheses in a string are balanced",
    "generates the first n prime numbers",
    "computes the dot product of two vectors",
    "returns the keys of a dictionary sorted by value",
    "finds all pairs in a list that sum to a target",
    "compresses a string with run-length encoding",
]
_CODE_SHAPES = [
    "Write a Python function that {task}.",
    "Write a short Python program that {task}, with a docstring.",
    "Show me Python code that {task} and explain it briefly.",
    "Write a JavaScript function that {task}.",
    "How would I write a function that {task}? Use Python.",
]
_TOPICS = [
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "the internet",
    "volcanoes",
    "coffee",
    "the human heart",
    "electric cars",
    "honey bees",
    "the Roman Empire",
    "climate change",
    "the piano",
    "machine learning",
    "the Great Wall of China",
    "vaccines",
    "rainbows",
    "earthquakes",
    "the stock market",
    "dinosaurs",
    "the solar system",
    "recycling",
    "sleep",
    "gravity",
    "democracy",
    "the ocean tides",
    "bicycles",
    "chocolate",
    "the printing press",
    "antibiotics",
    "clouds",
]
_TOPIC_SHAPES = [
    "Explain {topic} in simple terms.",
    "What are three interesting facts about {topic}?",
    "Write a short paragraph about {topic}.",
    "Why is {topic} important?",
    "Give me a brief history of {topic}.",
    "Write a short poem about {topic}.",
]


def training_prompts(count: int, seed: int = 0, exclude: set[str] | None = None) -> list[str]:
    """`count` distinct prompts (fewer if the lists run out), in a seeded order."""
    pool = [shape.format(task=task) for shape in _CODE_SHAPES for task in _CODE_TASKS]
    pool += [shape.format(topic=topic) for shape in _TOPIC_SHAPES for topic in _TOPICS]
    pool = sorted(set(pool) - (exclude or set()))
    random.Random(seed).shuffle(pool)
    return pool[:count]
