#!/usr/bin/env python3
"""Build benchmarks/dev-prompts.jsonl, the outside development suite, from public datasets.

The controller's priors are fitted on this suite, never on benchmarks/prompts.jsonl (ours) nor on
Spec-Bench's questions (the project is measured on those from outside). None of the sources below is
one of Spec-Bench's (MT-bench, WMT14 de-en, CNN/DailyMail, Natural Questions, GSM8K test, NQ + DPR):

| category | source (repository, file) | licence |
|---|---|---|
| translation | SQuAD 2.0 paragraphs (English Wikipedia), chrischute/squad data/test-v2.0.json, into German, French or Spanish | CC BY-SA 4.0 |
| summarisation | QMSum query-based meeting summarisation, Yale-LILY/QMSum data/ALL/jsonl/test.jsonl | MIT (repository); transcripts AMI / ICSI CC BY 4.0, Welsh Parliament OGL |
| qa | TruthfulQA questions (sylinrl/TruthfulQA), copy in benedictflorance/truthfulqa_experiments datasets/TruthfulQA.csv | Apache-2.0 |
| math | GSM8K train split, openai/grade-school-math grade_school_math/data/train.jsonl | MIT |
| rag | SQuAD 2.0 dev articles (several paragraphs of one Wikipedia article, then one of its questions), chrischute/squad data/dev-v2.0.json | CC BY-SA 4.0 |
| multi-turn | Schema-Guided Dialogue dev dialogues (the conversation so far, the model writes the next system turn), google-research-datasets/dstc8-schema-guided-dialogue dev/dialogues_001.json | CC BY-SA 4.0 |
| code | HumanEval, openai/human-eval data/HumanEval.jsonl.gz | MIT |

The repositories are read from local git mirrors (`--mirror`, one folder per owner+name, as the
project's `fetch` tool leaves them); every prompt records repository@commit:path and its item.
Selection is deterministic (every n-th item), so the same mirrors give the same file.

    python scripts/build_dev_suite.py [--mirror /work/.mirror] [--out benchmarks/dev-prompts.jsonl]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PER_CATEGORY = 8


class Mirror:
    def __init__(self, root: Path, repo: str):
        self.repo = repo
        folder = root / repo.replace("/", "+") / "repo"
        self.git_dir = folder / ".git" if (folder / ".git").is_dir() else folder
        self.commit = self._git("rev-parse", "HEAD").decode().strip()

    def _git(self, *args) -> bytes:
        return subprocess.run(["git", f"--git-dir={self.git_dir}", *args], check=True, capture_output=True).stdout

    def read(self, path: str) -> bytes:
        return self._git("show", f"{self.commit}:{path}")

    def source(self, path: str, item) -> str:
        return f"{self.repo}@{self.commit[:12]}:{path}#{item}"


def spread(items: list, n: int) -> list:
    """n items evenly spaced over the list (deterministic, not the first n: those are often alike)."""
    step = max(1, len(items) // n)
    return items[::step][:n]


def translation(root: Path) -> list[dict]:
    m, path = Mirror(root, "chrischute/squad"), "data/test-v2.0.json"
    articles = json.loads(m.read(path))["data"]
    languages = ["German", "French", "Spanish"]
    out = []
    for i, article in enumerate(spread(articles, PER_CATEGORY)):
        paragraph = article["paragraphs"][1]["context"]
        language = languages[i % len(languages)]
        out.append(
            {
                "category": "translation",
                "prompt": f"Translate the following text into {language}.\n\n{paragraph}",
                "source": m.source(path, f"{article['title']}/paragraph 1"),
                "license": "CC BY-SA 4.0",
            }
        )
    return out


def summarisation(root: Path, max_chars: int = 6000) -> list[dict]:
    m, path = Mirror(root, "Yale-LILY/QMSum"), "data/ALL/jsonl/test.jsonl"
    meetings = [json.loads(line) for line in m.read(path).decode().splitlines() if line.strip()]
    out = []
    for n, meeting in spread(list(enumerate(meetings)), PER_CATEGORY):
        query = meeting["specific_query_list"][0]
        start, end = (int(x) for x in query["relevant_text_span"][0])
        turns = meeting["meeting_transcripts"][start : end + 1]
        text = "\n".join(f"{t['speaker']}: {t['content']}" for t in turns)[:max_chars]
        out.append(
            {
                "category": "summarisation",
                "prompt": f"Here is part of a meeting transcript.\n\n{text}\n\n{query['query']}",
                "source": m.source(path, f"line {n + 1}/specific query 0"),
                "license": "MIT (QMSum); transcripts CC BY 4.0 (AMI, ICSI) or Open Government Licence (Welsh Parliament)",
            }
        )
    return out


def qa(root: Path) -> list[dict]:
    m, path = Mirror(root, "benedictflorance/truthfulqa_experiments"), "datasets/TruthfulQA.csv"
    rows = list(csv.DictReader(io.StringIO(m.read(path).decode())))
    return [
        {
            "category": "qa",
            "prompt": row["Question"],
            "source": m.source(path, f"row {n + 1}") + " (copy of sylinrl/TruthfulQA TruthfulQA.csv)",
            "license": "Apache-2.0",
        }
        for n, row in spread(list(enumerate(rows)), PER_CATEGORY)
    ]


def math(root: Path) -> list[dict]:
    m, path = Mirror(root, "openai/grade-school-math"), "grade_school_math/data/train.jsonl"
    items = [json.loads(line) for line in m.read(path).decode().splitlines() if line.strip()]
    return [
        {
            "category": "math",
            "prompt": item["question"] + "\nSolve it step by step.",
            "source": m.source(path, f"line {n + 1}"),
            "license": "MIT",
        }
        for n, item in spread(list(enumerate(items)), PER_CATEGORY)
    ]


def rag(root: Path, max_chars: int = 7000) -> list[dict]:
    m, path = Mirror(root, "chrischute/squad"), "data/dev-v2.0.json"
    articles = json.loads(m.read(path))["data"]
    out = []
    for article in spread(articles, PER_CATEGORY):
        passages, size = [], 0
        for paragraph in article["paragraphs"]:
            if size + len(paragraph["context"]) > max_chars:
                break
            passages.append(paragraph)
            size += len(paragraph["context"])
        # an answerable question from the middle of the retrieved text
        qas = [q for p in passages[len(passages) // 2 :] for q in p["qas"] if not q.get("is_impossible")]
        question = qas[0]
        context = "\n\n".join(f"[{i + 1}] {p['context']}" for i, p in enumerate(passages))
        out.append(
            {
                "category": "rag",
                "prompt": f"Answer the question using the retrieved passages below; quote the passage "
                f"that supports your answer.\n\n{context}\n\nQuestion: {question['question']}",
                "source": m.source(path, f"{article['title']}/question {question['id']}"),
                "license": "CC BY-SA 4.0",
            }
        )
    return out


def multi_turn(root: Path) -> list[dict]:
    m, path = Mirror(root, "google-research-datasets/dstc8-schema-guided-dialogue"), "dev/dialogues_001.json"
    dialogues = [d for d in json.loads(m.read(path)) if len(d["turns"]) >= 8]
    out = []
    for dialogue in spread(dialogues, PER_CATEGORY):
        turns = dialogue["turns"]
        cut = len(turns) // 2 * 2 - 2 if len(turns) % 2 == 0 else len(turns) - 1  # end on a user turn
        cut = min(cut, 9)  # at most 5 user turns
        messages = [
            {"role": "user" if t["speaker"] == "USER" else "assistant", "content": t["utterance"]} for t in turns[:cut]
        ]
        if messages[-1]["role"] != "user":
            messages = messages[:-1]
        messages[0] = {
            "role": "user",
            "content": "You are a helpful assistant for "
            + ", ".join(s.split("_")[0].lower() for s in dialogue["services"])
            + " bookings; answer in full sentences and suggest options.\n\n"
            + messages[0]["content"],
        }
        flat = "\n".join(f"{x['role']}: {x['content']}" for x in messages)
        out.append(
            {
                "category": "multi-turn",
                "prompt": flat,
                "messages": messages,
                "source": m.source(path, f"dialogue {dialogue['dialogue_id']}, first {len(messages)} turns"),
                "license": "CC BY-SA 4.0",
            }
        )
    return out


def code(root: Path) -> list[dict]:
    m, path = Mirror(root, "openai/human-eval"), "data/HumanEval.jsonl.gz"
    items = [json.loads(line) for line in gzip.decompress(m.read(path)).decode().splitlines() if line.strip()]
    return [
        {
            "category": "code",
            "prompt": "Complete this Python function; reply with the whole function in "
            f"a code block.\n\n```python\n{item['prompt']}```",
            "source": m.source(path, item["task_id"]),
            "license": "MIT",
        }
        for item in spread(items, PER_CATEGORY)
    ]


BUILDERS = (translation, summarisation, qa, math, rag, multi_turn, code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mirror", default="/work/.mirror", help="folder of git mirrors (owner+name/repo)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "dev-prompts.jsonl"))
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as out:
        for build in BUILDERS:
            items = build(Path(args.mirror))
            for n, item in enumerate(items, 1):
                item = {"id": f"{item['category']}-{n:02d}", **item}
                out.write(json.dumps(item, ensure_ascii=False) + "\n")
            print(f"{build.__name__}: {len(items)} prompts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
