"""Replays a bench run's answers through specdec.vllm's proposers on the recorded vLLM runner
(tests/vllm_runner.py), on a timed vLLM cost curve, the suite asked twice in one proposer (pass 2:
the exact repeats). The target is the bench's plain answers: each prompt's answer is what the
target says, so the replay counts steps and prices them on the curve, with no model loaded.

    python benchmarks/vllm_replay.py RESULTS.jsonl COSTS.json [--reach 0.5 1 2] [--learn-live] [--idle S]

RESULTS.jsonl: a `specdec bench` results file (its `plain` rows' token ids); COSTS.json: a curve
from `python -m specdec.vllm_peer costs` (benchmarks/cpu/vllm-costs-0.5b-bf16.json). Prints
simulated tokens/s per proposer and pass; --reach replays `auto` at each reach (FLAT_REACH's
provenance); --learn-live hides the curve from the proposers (they learn it from the time between
their calls, as without `vllm_peer costs`; LIVE_MEMORY's provenance); --idle S leaves the engine
idle S seconds between requests, as a bench does (not counted in tokens/s).
Run it with the vLLM venv's python (`make vllm-peer`), which has the tokenizer's package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("costs", type=Path)
    p.add_argument("--reach", type=float, nargs="*", default=[], help="replay auto at these reaches too")
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer makes the prompts")
    p.add_argument("--learn-live", action="store_true", help="the proposers learn the curve live")
    p.add_argument("--idle", type=float, default=0.0, help="seconds idle between requests")
    args = p.parse_args(argv)
    from tests.vllm_runner import Runner
    from tokenizers import Tokenizer

    from specdec import vllm as sv
    from specdec.costs import CostTable
    from specdec.peers import vllm_folder

    tokenizer = Tokenizer.from_file(str(vllm_folder(args.model) / "tokenizer.json"))
    suite = {json.loads(line)["id"]: json.loads(line) for line in (ROOT / "benchmarks" / "prompts.jsonl").open()}
    answers = {}
    for line in args.results.open():
        row = json.loads(line)
        if row["method"] == "plain" and "#" not in row["prompt_id"] and row["token_ids"]:
            answers[row["prompt_id"]] = row["token_ids"]
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts = {p: tokenizer.encode(template.format(suite[p]["prompt"]), add_special_tokens=False).ids for p in answers}
    table = {tuple(prompts[p]): answers[p] for p in answers}

    def target(context):
        for prompt, answer in table.items():
            if tuple(context[: len(prompt)]) == prompt:
                i = len(context) - len(prompt)
                return answer[i] if i < len(answer) else 0
        return 1

    curve = CostTable({int(w): s for w, s in json.loads(args.costs.read_text())["seconds"].items()})

    if args.learn_live:  # nowhere to find a curve (the tokenizer is loaded): a fresh home
        import tempfile

        os.environ["SPECDEC_HOME"] = tempfile.mkdtemp(prefix="vllm-replay-")
        os.environ.pop("SPECDEC_VLLM_COSTS", None)
    else:
        os.environ["SPECDEC_VLLM_COSTS"] = str(args.costs)

    def replay(name, proposer_class):
        runner = Runner(proposer_class, target, k=16, max_model_len=8192, vocab=151936, cost=curve)
        for pass_ in (1, 2):
            start, steps, tokens = runner.clock_now, runner.steps, 0
            for p in answers:
                request = runner.add(prompts[p], len(answers[p]))
                runner.run()
                runner.clock_now += args.idle
                start += args.idle
                assert request.output == answers[p], p
                tokens += len(answers[p])
            seconds = runner.clock_now - start
            print(f"{name} pass {pass_}: {runner.steps - steps} steps, {tokens / seconds:.1f} simulated tok/s")

    replay("auto", sv.Proposer)
    replay("suffix:16", sv.SuffixProposer)
    replay("ngram:16", sv.NgramProposer)
    for reach in args.reach:
        saved = sv.FLAT_REACH
        sv.FLAT_REACH = reach
        try:
            replay(f"auto, reach {reach}", sv.Proposer)
        finally:
            sv.FLAT_REACH = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
