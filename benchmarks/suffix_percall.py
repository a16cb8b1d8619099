"""Per-call time of the suffix cache at its default cap: the cache filled to DEFAULT_CAP tokens
(the recorded prompts and outputs of benchmarks/greedy-1.5b-0.5b.jsonl, each copy with 5% of its
tokens changed so that matches do not all run to the depth), then one propose per emitted token
over a recorded output, as the engine calls it (k = 15, the controller's K_MAX).

    python benchmarks/suffix_percall.py
"""

import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "src"))

from specdec.drafters.suffix import DEFAULT_CAP, SuffixCacheDrafter  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

records = [json.loads(line) for line in (HERE / "greedy-1.5b-0.5b.jsonl").read_text().splitlines()[1:]]
rng = random.Random(0)
cache = SuffixCacheDrafter()
t = time.perf_counter()
added = 0
while cache.tokens_stored < DEFAULT_CAP - 2000:
    rec = records[rng.randrange(len(records))]
    seq = [tok if rng.random() > 0.05 else rng.randrange(150000) for tok in rec["prompt"] + rec["output"]]
    cache.add(seq)
    added += len(seq)
fill = time.perf_counter() - t
times = []
for i, rec in enumerate(records):
    context = list(rec["prompt"])
    cache.begin(i, context, SamplingParams(), None)
    for tok in rec["output"]:
        t = time.perf_counter()
        cache.propose({i: context}, {i: 15})
        times.append(time.perf_counter() - t)
        context.append(tok)
    t = time.perf_counter()
    cache.end([i])
    times[-1] += time.perf_counter() - t
times.sort()
print(
    f"cache {cache.tokens_stored} tokens (filled in {fill:.1f} s, {1e6 * fill / added:.1f} us a token); "
    f"propose: median {1e6 * statistics.median(times):.0f} us, p95 {1e6 * times[int(0.95 * len(times))]:.0f} us, "
    f"max {1e6 * times[-1]:.0f} us over {len(times)} calls"
)
