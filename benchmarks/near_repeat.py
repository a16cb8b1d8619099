"""Writes benchmarks/near-repeat.jsonl: the near-repeat workload of the suffix cache (issue 15).

Two sessions, each the same material asked about again with another instruction, in order:

- near-repeat-edit: a multi-turn edit session on one Python module (code-editing-01's): every turn
  asks for the WHOLE file back with one more change, so every answer rewrites the same file;
- near-repeat-passage: one passage (summarization-01's) with three different tasks.

Run it in one process so that a learning drafter sees the earlier turns (bench keeps one decoder
per method for the whole run):

    specdec bench --suite benchmarks/near-repeat.jsonl --per-category 9 \
        --methods plain ngram:8 suffix:8 auto:nosuffix auto:suffix -n 128 --threads 2

Run this script again only if prompts.jsonl changes; the JSONL is committed.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
SUITE = {
    json.loads(line)["id"]: json.loads(line)
    for line in (HERE / "prompts.jsonl").read_text().splitlines()
    if line.strip()
}

EDIT_TURNS = [
    "Add complete type hints to the following Python module (modern annotations such as "
    "`dict[str, int]` and `X | None`). Do not change any behaviour.",
    "Add a one-line docstring to every function of the following Python module. Do not change any behaviour.",
    'In the following Python module, replace every `with open(path)` by `with open(path, encoding="utf-8")` '
    "and change nothing else.",
    "Rename the parameter `path` to `file_path` everywhere in the following Python module. Do not "
    "change any behaviour.",
]
PASSAGE_TASKS = [
    "Summarise this incident report in five bullet points for an engineer who was not there.",
    "List every time mentioned in the report, in order, each with what happened at that time.",
    "Write the short e-mail the on-call engineer would send to customer support about this incident, "
    "quoting the key facts from the report.",
]


def main() -> None:
    edit = SUITE["code-editing-01"]["prompt"]
    code = edit[edit.index("```python") : edit.rindex("```") + 3]
    passage = SUITE["summarization-01"]["prompt"]
    passage = passage[passage.index("---") : passage.rindex("---") + 3]
    items = [
        {
            "id": f"near-repeat-edit-{i + 1}",
            "category": "near-repeat-edit",
            "prompt": f"{turn} Return the WHOLE edited file in a single code block and nothing else.\n\n{code}",
        }
        for i, turn in enumerate(EDIT_TURNS)
    ]
    items += [
        {
            "id": f"near-repeat-passage-{i + 1}",
            "category": "near-repeat-passage",
            "prompt": f"Read the following passage and then complete the task below it.\n\n{passage}\n\n{task}",
        }
        for i, task in enumerate(PASSAGE_TASKS)
    ]
    with open(HERE / "near-repeat.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
