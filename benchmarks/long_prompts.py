"""The `long` benchmark prompt set: a question about something pasted before it (a server log, a CSV
table, a Python module, a meeting transcript), 700 to 2,400 tokens a prompt, as a chat server sees when
users paste their material. A tree's verify attention grows with the context where its linears do not,
so here a step costs DART the most; answers also copy from the material, which the context chains draft
(throughput run 117: DART's speed-up came out larger here than on the varied prompts).

The pasted material is generated here from fixed seeds (the same prompts on every machine) and is not
taken from anywhere a drafter may have trained on; like every benchmark prompt it is kept out of
training by `bench_prompts.py --exclude-file`.
"""

from __future__ import annotations

import random

SERVICES = ["auth", "billing", "search", "gateway", "storage", "mailer", "scheduler"]
REGIONS = ["north", "south", "east", "west", "central"]
PEOPLE = ["Amira", "Bruno", "Chen", "Dana", "Emeka", "Freya"]
LIST_PRICES = {"kettle": 24, "toaster": 31, "blender": 58, "lamp": 19, "fan": 42, "heater": 67, "scale": 15}
PRODUCTS = list(LIST_PRICES)


def _clock(rng: random.Random, start_minute: int) -> tuple[str, int]:
    minute = start_minute + rng.randint(0, 3)
    return f"2026-03-14 {9 + minute // 60:02d}:{minute % 60:02d}:{rng.randint(0, 59):02d}", minute


def server_log(seed: int, lines: int) -> str:
    """A service log: routine INFO lines, and a storage fault that makes other services fail later."""
    rng = random.Random(seed)
    minute, out = 0, []
    faulty = rng.choice(["vol-3", "vol-7", "vol-12"])
    for n in range(lines):
        stamp, minute = _clock(rng, minute)
        service = rng.choice(SERVICES)
        late = n > lines // 2
        if service == "storage" and late and rng.random() < 0.5:
            out.append(f"{stamp} ERROR storage: write to {faulty} failed: disk quota exceeded")
        elif late and rng.random() < 0.12:
            out.append(f"{stamp} ERROR {service}: request {rng.randint(1000, 9999)} timed out after 30s")
        elif rng.random() < 0.08:
            out.append(f"{stamp} WARN  {service}: slow response ({rng.randint(800, 2500)} ms)")
        else:
            what = rng.choice(["request served", "cache refreshed", "job finished", "session opened"])
            out.append(f"{stamp} INFO  {service}: {what} in {rng.randint(3, 240)} ms")
    return "\n".join(out)


def sales_table(seed: int, rows: int) -> str:
    rng = random.Random(seed)
    out = ["date,region,product,units,unit_price"]
    for _ in range(rows):
        day = f"2026-0{rng.randint(1, 6)}-{rng.randint(1, 28):02d}"
        product = rng.choice(PRODUCTS)
        units, price = rng.randint(1, 40), LIST_PRICES[product] + rng.randint(0, 5)
        out.append(f"{day},{rng.choice(REGIONS)},{product},{units},{price}.99")
    return "\n".join(out)


def python_module(seed: int, functions: int) -> str:
    """An order-handling module of small functions, one of them with an off-by-one bug."""
    rng = random.Random(seed)
    fields = ["price", "quantity", "discount", "weight", "tax_rate", "shipping"]
    parts = [
        '"""Order handling for the shop backend."""',
        "",
        "from dataclasses import dataclass, field",
        "",
        "",
        "@dataclass",
        "class Order:",
        "    id: int",
        "    customer: str",
        "    items: list[dict] = field(default_factory=list)",
        "    status: str = 'open'",
    ]
    buggy = rng.randrange(functions)
    for n in range(functions):
        name, what = rng.choice(fields), rng.choice(["total", "largest", "count_over", "average"])
        what = "average" if n == buggy else what
        parts += ["", ""]
        if what == "total":
            parts += [
                f"def total_{name}_{n}(order: Order) -> float:",
                f"    return sum(item.get('{name}', 0) for item in order.items)",
            ]
        elif what == "largest":
            parts += [
                f"def largest_{name}_{n}(order: Order) -> float:",
                "    best = 0.0",
                "    for item in order.items:",
                f"        best = max(best, item.get('{name}', 0))",
                "    return best",
            ]
        elif what == "count_over":
            parts += [
                f"def count_{name}_over_{n}(order: Order, limit: float) -> int:",
                f"    return sum(1 for item in order.items if item.get('{name}', 0) > limit)",
            ]
        else:
            stop = "len(values) - 1" if n == buggy else "len(values)"
            parts += [
                f"def average_{name}_{n}(order: Order) -> float:",
                f"    values = [item.get('{name}', 0) for item in order.items]",
                "    if not values:",
                "        return 0.0",
                f"    return sum(values[:{stop}]) / len(values)",
            ]
    return "\n".join(parts)


def meeting_transcript(seed: int, turns: int) -> str:
    rng = random.Random(seed)
    topics = ["the release date", "the on-call rota", "the new office", "the hiring plan", "the budget"]
    moves = [
        "I think we should move {t} by two weeks.",
        "Can we get numbers on {t} before we decide?",
        "I disagree, {t} is fine as it is.",
        "Let's agree that {p} owns {t} from now on.",
        "I'll write up a proposal for {t} by Friday.",
        "What does the customer team say about {t}?",
        "We decided last month to keep {t} unchanged.",
    ]
    out = []
    for _ in range(turns):
        line = rng.choice(moves).format(t=rng.choice(topics), p=rng.choice(PEOPLE))
        out.append(f"{rng.choice(PEOPLE)}: {line}")
    return "\n".join(out)


LONG: list[str] = [
    "Here is an excerpt of our server log:\n\n"
    + server_log(1, 40)
    + "\n\nWhich services reported errors, how often, and what is the most likely root cause?",
    "Here is the log from last night's incident:\n\n"
    + server_log(2, 70)
    + "\n\nWrite a short incident report: what failed first, what followed, and what to fix.",
    "Here is our sales data as CSV:\n\n"
    + sales_table(3, 60)
    + "\n\nWhich region sold the most units, and which product brought in the most revenue there?",
    "This CSV holds the first half-year of sales:\n\n"
    + sales_table(4, 90)
    + "\n\nDescribe the main trends and suggest two charts that would show them well.",
    "Review this Python module. Point out any bug and suggest three improvements:\n\n" + python_module(5, 14),
    "Write pytest tests for the functions of this module:\n\n" + python_module(6, 28),
    "Here is the transcript of today's team meeting:\n\n"
    + meeting_transcript(7, 40)
    + "\n\nWrite the minutes: decisions, open questions, and action items with their owners.",
    "Summarise this long meeting for someone who missed it, in at most eight bullet points:\n\n"
    + meeting_transcript(8, 100),
]
