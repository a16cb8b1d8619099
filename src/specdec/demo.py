"""`specdec demo`: plain decoding against `--draft auto` on two requests, where speculation pays
and where it steps aside, each with the reason the controller gives for what it did."""

from __future__ import annotations

import time

from .compare import compare
from .config import GenerationConfig

# A code edit: the answer is the function again with a small change, so most of it copies the
# prompt and prompt lookup drafts long runs of it.
EDIT_PROMPT = '''Add a `timeout` parameter (default 10 seconds) to this function and pass it to \
`urlopen`. Reply with the whole updated function and nothing else.

```python
import json
import time
from urllib.request import Request, urlopen


def fetch_json(url, retries=3, backoff=0.5, headers=None):
    """GET `url` and decode its JSON body, retrying on network errors.

    Waits backoff, 2 * backoff, 4 * backoff, ... seconds between attempts and raises the last
    error when every attempt failed.
    """
    request = Request(url, headers=headers or {"Accept": "application/json"})
    last_error = None
    for attempt in range(retries):
        try:
            with urlopen(request) as response:
                charset = response.headers.get_content_charset() or "utf-8"
                return json.loads(response.read().decode(charset))
        except OSError as error:
            last_error = error
            time.sleep(backoff * 2 ** attempt)
    raise last_error
```'''

# Open generation: nothing in the prompt to copy, and on this kind of CPU the draft model costs too
# much of a target step to pay; `auto` should take plain steps.
OPEN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

REQUESTS = (
    ("code edit", "the answer copies most of the prompt", EDIT_PROMPT, 224),
    ("open generation", "nothing to copy", OPEN_PROMPT, 96),
)


# the least difference between runs that is told as a win or a loss, however close plain
# decoding's two runs came (on the 2-core development machine a second plain run reads 0.88-1.12x
# of the first, per prompt)
MIN_NOISE = 0.05
STEPPED_ASIDE = 0.1  # auto drafted on fewer than this share of its steps: it stepped aside


def judge(result) -> str:
    """The verdict on a comparison whose plain decoding ran twice: a win or a loss only beyond the
    noise those two runs show; where auto stepped aside, that, whatever the timings say."""
    s = result.speculative.stats
    drafted = sum(n for kind, n in s.steps_by_kind().items() if kind != "plain")
    band = max(result.noise or 0.0, MIN_NOISE)
    if drafted < STEPPED_ASIDE * max(s.steps, 1):
        return f"auto stepped aside (drafted on {drafted} of {s.steps} steps): plain decoding, as it should be"
    if result.speedup > 1 + band:
        return f"auto won, beyond the {band:.0%} the runs vary by"
    if result.speedup < 1 - band:
        return f"auto lost, beyond the {band:.0%} the runs vary by"
    return f"within the {band:.0%} the runs vary by: no measured difference"


def reason(stats, controller) -> str:
    """The controller's account of a run: what it chose, what it expected, what a step costs."""
    steps = stats.steps or 1
    by_kind = stats.steps_by_kind()
    plain = by_kind.pop("plain", 0)
    drafted = bool(by_kind)
    names = {"ngram": "prompt lookup", "draft": "the draft model"}
    if drafted:
        choice = ", ".join(f"{names.get(kind, kind)} on {n}" for kind, n in by_kind.items())
        what = f"drafted with {choice} of {steps} steps, plain on {plain}"
    else:
        what = f"took plain steps on all {steps}: no draft promised 10% more tokens/s than a plain step"
    predicted = stats.predicted_speedup or 1.0
    base = controller.target_cost.base  # width -> seconds of a target forward, measured
    costs = f"a target forward of 2 tokens costs {base[2] / base[1]:.2f}x one token"
    costs += f", of 16 tokens {base[16] / base[1]:.1f}x"
    if controller.draft_cost is not None:
        costs += f", a draft-model token {controller.draft_cost.base[1] / base[1]:.2f}x a target step"
    return f"auto {what}; predicted {predicted:.2f}x. Measured costs: {costs}."


def run_demo(decoder, stats: bool = False, out=print) -> int:
    started = time.perf_counter()
    target = decoder.target
    model = decoder.model_drafter
    out(
        f"target {target.name}, --draft auto (prompt lookup{f' + {model.model.name}' if model else ''}), "
        f"greedy, {getattr(target, 'n_threads', '?')} threads"
    )
    controller = decoder.controller()  # measures the cost curves on first use (cached afterwards)
    for i, (title, why, prompt, n) in enumerate(REQUESTS, 1):
        result = compare(decoder, prompt, GenerationConfig(max_new_tokens=n), repeat_plain=True)
        s = result.speculative.stats
        verdict = judge(result)
        out(f"\n{i}. {title} ({why}), {s.generated_tokens} tokens:")
        first_lines = [line for line in result.speculative.text.strip().splitlines() if line.strip()][:3]
        for line in first_lines:
            out(f"   | {line[:96]}")
        out(
            f"   plain {result.plain_tokens_per_second:.1f} tok/s (two runs, {result.noise:.0%} apart), "
            f"auto {s.tokens_per_second:.1f} tok/s: "
            f"{result.speedup:.2f}x, {verdict}; outputs {result.verdict()}"
        )
        out(f"   {reason(s, controller)}")
        if stats:
            out(
                f"   acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted}), mean accepted length "
                f"{s.mean_accepted_length:.2f}, decisions "
                + " ".join(f"{k}={v}" for k, v in sorted(s.decisions.items(), key=lambda kv: -kv[1]))
            )
    out(f'\n{time.perf_counter() - started:.0f} s. Try your own: specdec compare -p "..." --stats')
    return 0
