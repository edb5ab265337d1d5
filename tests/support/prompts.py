"""Prompts for greedy-equality tests: chat and code, short enough for a 2-core CPU."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in two sentences.",
    "List three primary colors.",
    "Give me a short tip for learning a new language.",
    "What does HTTP stand for?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]

CODE_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses a string.",
    "Write a function that returns the n-th Fibonacci number in Python.",
    "Write a Python class for a stack with push and pop.",
]

ALL_PROMPTS = CHAT_PROMPTS + CODE_PROMPTS


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
