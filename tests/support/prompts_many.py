"""Many varied prompts (chat questions and code) for greedy-equality tests across batch sizes."""

from __future__ import annotations

from tests.support.prompts import ALL_PROMPTS

_TOPICS = ["rivers", "prime numbers", "sorting", "the moon", "bread", "chess", "rain", "compilers"]
_CODE = [
    "def {name}(items):\n    result = []\n    for item in items:\n",
    "class {Name}:\n    def __init__(self, value):\n        self.value = value\n",
    "import os\nimport sys\n\ndef {name}(path):\n    with open(path) as f:\n",
    "# {name}: parse a line of text\ndef {name}(line):\n    parts = line.split(",
]


def many_prompts(count: int = 56) -> list[str]:
    prompts = list(ALL_PROMPTS)
    i = 0
    while len(prompts) < count:
        topic = _TOPICS[i % len(_TOPICS)]
        name = f"handle_{topic.replace(' ', '_')}_{i}"
        prompts.append(
            f"Tell me one fact about {topic}."
            if i % 2
            else _CODE[i % len(_CODE)].format(name=name, Name=name.title().replace("_", ""))
        )
        i += 1
    return prompts[:count]
