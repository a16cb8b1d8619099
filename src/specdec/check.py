"""`specdec check`: is this engine lossless? Evidence, for our decoder in-process or for any
OpenAI-compatible server.

- Greedy: speculative against plain output over a prompt set. Every parting is located (the first
  differing token) and, where the target's logits (or a server's top log-probabilities) are at
  hand, classed by the target's top-2 gap there: a rounding tie (gap < compare.ROUNDING_GAP) or a
  bug. After a tie the speculative output must stay the target's greedy output, replayed one
  token at a time as plain decoding computes it. In the exact mode there is no tie allowance.
- Sampled: many seeded short continuations. (a) Every sampled position (those speculation drafts
  and verifies) against the target's own probabilities: at each position the samples are grouped
  by the tokens before it, and each group of MIN_GROUP or more is compared with p(. | prompt,
  prefix) (Pearson chi-square over the tokens with an expected count >= 5 plus one "rest" bin; the
  groups' statistics add up). In-process p is the target's, scored one token at a time; for a
  server, the probabilities it reports at that prefix (its logprobs, at temperature 1 without
  filters). Outside the exact mode a token the reference filters out (top-k, top-p, min-p) by
  less than ROUNDING_GAP of logit is possible, not a failure: the engine's batched logits may
  carry it across the cut. (b) A two-sample chi-square between speculative and plain samples at
  the last position, where the prefixes have parted into groups too small for (a). Each test
  states its power: the smallest total-variation shift (between the binned distributions) that
  it detects with probability POWER at its level.

Every test runs at alpha / (number of tests) (Bonferroni), so the whole check's false-alarm rate
is at most alpha. Nothing here changes what the engine does; a broken verifier must fail it
(tests/test_check.py pins both)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from .compare import ROUNDING_GAP, first_difference, logit_gap
from .config import GenerationConfig
from .errors import SpecdecError
from .sampling import SamplingParams, logits_to_probs

ALPHA = 0.01  # the whole check's false-alarm rate (split over its tests)
POWER = 0.8  # the detection probability the stated "detectable shift" is computed for
MIN_EXPECTED = 5  # a chi-square cell needs an expected count of 5 (Cochran's rule); smaller ones pool into "rest"
TWO_SAMPLE_FROM = 2  # the two-sample test reads the last position once it is this deep
MIN_GROUP = 20  # samples a prefix needs before its next token is tested against p(. | prefix)
END = -1  # an outcome's marker: generation ended (an end-of-generation token) there
# The reference probability of a token a rounding could carry across a filter's cut (target_probs):
# possible, so no "zero-probability" failure, but no expected count: its samples weigh in the rest bin.
NEAR_CUT = 1e-12

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences what a hash map is.",
    "Rename the variable `x` to `total` in this code:\n\ndef f(items):\n    x = 0\n    for i in items:\n"
    "        x += i\n    return x\n",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Give three tips for writing clear commit messages.",
    "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]\n",
)


# -- results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parting:
    """Where one prompt's speculative greedy output left plain decoding's."""

    prompt: int  # index into the prompt set
    index: int  # the first differing token (or character, where no tokens were seen)
    gap: float | None  # the target's top-1 minus top-2 logit there; None: not known
    kind: str  # "tie" (a rounding tie), "bug", or "unknown" (no logits to tell)
    detail: str

    @property
    def failed(self) -> bool:
        return self.kind != "tie"


@dataclass(frozen=True)
class StatTest:
    """One distribution test: its statistic, p-value and power."""

    name: str
    setting: str  # the sampling settings, in words
    samples: int  # speculative samples it read
    statistic: float
    df: int
    p_value: float
    level: float  # the test's own alpha (alpha / number of tests)
    detectable_tv: float | None  # smallest TV shift detected with probability POWER at `level`
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.p_value >= self.level


@dataclass
class CheckReport:
    engine: str
    alpha: float
    exact: bool = False
    greedy_prompts: int = 0
    greedy_identical: int = 0
    greedy_plain: bool = True  # greedy output was compared with plain output (else: only with its own logprobs)
    partings: list[Parting] = field(default_factory=list)
    tests: list[StatTest] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was and was not checked, and why

    @property
    def passed(self) -> bool:
        return not any(p.failed for p in self.partings) and all(t.passed for t in self.tests)

    @property
    def checked(self) -> bool:
        return bool(self.greedy_prompts or self.tests)

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "lossless": self.passed,
            "alpha": self.alpha,
            "power": POWER,
            "exact": self.exact,
            "greedy": {
                "prompts": self.greedy_prompts,
                "identical": self.greedy_identical if self.greedy_plain else None,
                "partings": [asdict(p) | {"failed": p.failed} for p in self.partings],
            },
            "sampled": [asdict(t) | {"passed": t.passed} for t in self.tests],
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        out = [f"engine    {self.engine}"]
        if self.greedy_prompts and not self.greedy_plain:
            out.append(
                f"greedy    {self.greedy_prompts} prompts, each token against the server's own log-probabilities"
            )
        elif self.greedy_prompts:
            out.append(
                f"greedy    {self.greedy_identical} of {self.greedy_prompts} prompts identical to plain decoding"
                + (" (exact mode: no tie allowance)" if self.exact else "")
            )
            for p in self.partings:
                out.append(f"  prompt {p.prompt}: {'FAIL' if p.failed else 'tie '} {p.detail}")
        if self.tests:
            n = len(self.tests)
            out.append(
                f"sampled   {n} test{'s' if n > 1 else ''}, each at alpha {self.alpha:g}/{n}; detectable = the "
                f"smallest total-variation shift found with probability {POWER:g}"
            )
            for t in self.tests:
                tv = f"{t.detectable_tv:.3f}" if t.detectable_tv is not None else "-"
                out.append(
                    f"  {'pass' if t.passed else 'FAIL'}  {t.name} [{t.setting}]: n={t.samples} "
                    f"chi2={t.statistic:.1f} df={t.df} p={t.p_value:.3g} detectable={tv}"
                    + (f" ({t.detail})" if t.detail else "")
                )
        for note in self.notes:
            out.append(f"note      {note}")
        verdict = "LOSSLESS within the tests' power" if self.passed else "NOT LOSSLESS: see the FAIL lines above"
        out.append(f"verdict   {verdict}")
        return out


# -- greedy -----------------------------------------------------------------------------------------


def _gap_and_argmax(row: np.ndarray) -> tuple[float, int]:
    return logit_gap(row), int(np.argmax(row))


def greedy_parting(
    target, prompt_tokens: Sequence[int], plain: Sequence[int], speculative: Sequence[int], exact: bool = False
) -> tuple[int, float | None, str | None]:
    """Where speculative greedy output parts from plain output, and whether that is allowed:
    (first differing index, the target's top-2 gap there, the problem or None). Allowed: a parting
    at a rounding tie (gap < ROUNDING_GAP; none in the exact mode) after which every speculative
    token is still the target's argmax (or a tie) given the speculative prefix, replayed one token
    at a time as plain decoding computes it. Uses one spare row of `target`. Identical lists give
    (len, None, None)."""
    plain, speculative = list(plain), list(speculative)
    first = first_difference(plain, speculative)
    if plain == speculative:
        return first, None, None
    tie = 0.0 if exact else ROUNDING_GAP
    gap_at_first = None
    [r] = target.add_rows(1)
    try:
        if len(prompt_tokens) > 1:
            target.forward_rows({r: list(prompt_tokens[:-1])})
        row = target.forward_rows({r: list(prompt_tokens[-1:])}, {r: 1})[r][0]  # [vocab]
        for j, token in enumerate(speculative):
            gap, best = _gap_and_argmax(row)
            if j == first:
                gap_at_first = gap
                if j < len(plain) and gap >= tie:
                    return (
                        first,
                        gap,
                        f"outputs part at token {j} where the target's top-2 gap is {gap:.3f}"
                        + (
                            " (exact mode: any parting is a bug)"
                            if exact
                            else f" (>= {ROUNDING_GAP}): not a rounding tie"
                        ),
                    )
            if token != best and gap >= tie:
                return (
                    first,
                    gap_at_first,
                    f"speculative token {j} is {token}, but the target's argmax is {best} with a top-2 gap of "
                    f"{gap:.3f} (>= {tie}): not a rounding tie",
                )
            row = target.forward_rows({r: [token]}, {r: 1})[r][0]
        if first == len(speculative) < len(plain):  # the speculative run ended first
            gap, _ = _gap_and_argmax(row)
            gap_at_first = gap
            if gap >= tie:
                return (
                    first,
                    gap,
                    f"the speculative output ends at token {first}, where plain decoding goes on and the "
                    f"target's top-2 gap is {gap:.3f}: not a rounding tie",
                )
    finally:
        target.drop_rows([r])
    return first, gap_at_first, None


def _parting(prompt: int, first: int, gap: float | None, problem: str | None) -> Parting:
    if problem is not None:
        return Parting(prompt, first, gap, "bug", problem)
    return Parting(
        prompt,
        first,
        gap,
        "tie",
        f"parts at token {first}, top-2 gap {gap:.4f} < {ROUNDING_GAP}: a rounding tie of the target's "
        f"kernels, greedy after it",
    )


# -- statistics ------------------------------------------------------------------------------------


def _chi2():
    try:
        from scipy import stats
    except ImportError:
        raise SpecdecError(
            "specdec check needs scipy for its tests: pip install -e '.[check]' (in specdec's checkout)"
        ) from None
    return stats


def goodness_of_fit(counts: Counter, probs: dict, complete: bool = True) -> tuple[float, int, int]:
    """Pearson chi-square of observed `counts` against `probs` (outcome -> probability; missing:
    0, unless not `complete`: then `probs` lists only the likeliest outcomes, as a server's top
    log-probabilities do, and the others share the rest): (statistic, df, samples of
    zero-probability outcomes). Outcomes with an expected count >=
    MIN_EXPECTED are cells of their own; the rest pool into one cell (folded into the smallest
    cell when even the pool is too small)."""
    n = sum(counts.values())
    impossible = sum(c for o, c in counts.items() if complete and probs.get(o, 0.0) <= 0.0)
    big = [o for o, p in probs.items() if p * n >= MIN_EXPECTED]
    obs = [counts.get(o, 0) for o in big]
    exp = [probs[o] * n for o in big]
    rest_obs, rest_exp = n - sum(obs), max(n - sum(exp), 0.0)
    if rest_exp >= MIN_EXPECTED or not big:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif big:
        j = int(np.argmin(exp))
        obs[j] += rest_obs
        exp[j] += rest_exp
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    ok = exp > 0
    stat = float(((obs[ok] - exp[ok]) ** 2 / exp[ok]).sum())
    return stat, max(len(exp) - 1, 0), impossible


def two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square test of homogeneity of two samples of outcomes: (statistic, df). Outcomes with
    a pooled count >= 2 * MIN_EXPECTED are cells; the rest pool into one."""
    pooled = a + b
    big = [o for o, c in pooled.items() if c >= 2 * MIN_EXPECTED]
    rows = [[a.get(o, 0) for o in big], [b.get(o, 0) for o in big]]
    rest = [sum(a.values()) - sum(rows[0]), sum(b.values()) - sum(rows[1])]
    if sum(rest) >= 2 * MIN_EXPECTED or not big:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    elif big:
        j = int(np.argmin([pooled[o] for o in big]))
        rows[0][j] += rest[0]
        rows[1][j] += rest[1]
    table = np.array(rows, dtype=np.float64)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2 or (table.sum(axis=1) == 0).any():
        return 0.0, 0
    stat, _, df, _ = _chi2().chi2_contingency(table, correction=False)
    return float(stat), int(df)


def detectable_tv(df: int, level: float, n_eff: float, power: float = POWER) -> float | None:
    """The smallest total-variation shift d that a chi-square test of `df` degrees of freedom at
    `level` detects with probability `power`. A shift D of the cell probabilities p gives the
    noncentrality n_eff * sum(D^2 / p) >= 4 n_eff d^2 (Cauchy-Schwarz: (sum |D|)^2 <= sum(D^2/p) *
    sum(p)), so any shift of TV >= d = sqrt(lambda* / (4 n_eff)) is detected at least that often,
    lambda* being the noncentrality that reaches `power`. n_eff: the samples (goodness of fit) or
    n1 n2 / (n1 + n2) (two samples)."""
    if df < 1 or n_eff <= 0:
        return None
    stats = _chi2()
    from scipy.optimize import brentq

    crit = stats.chi2.isf(level, df)
    lam = brentq(lambda x: stats.ncx2.sf(crit, df, x) - power, 1e-9, 1e6)
    return float(min(1.0, np.sqrt(lam / (4 * n_eff))))


def _setting(params: SamplingParams) -> str:
    parts = [f"temperature {params.temperature:g}"]
    if params.top_k:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1:
        parts.append(f"top-p {params.top_p:g}")
    if params.min_p:
        parts.append(f"min-p {params.min_p:g}")
    return ", ".join(parts)


def positions_test(
    samples: Sequence[tuple], probs: Callable[[tuple], dict | None], positions: int, complete: bool = True
) -> tuple[float, int, int, int, int]:
    """The first `positions` tokens of `samples` (outcomes: token tuples, END where generation
    ended) against the target: at position j the samples are grouped by their first j tokens, and
    each group of MIN_GROUP or more is compared with probs(prefix) (outcome -> probability, END for
    the end-of-generation tokens; None: not known, the group is skipped; `complete` as in
    goodness_of_fit). Returns (summed statistic, summed df, samples tested (summed over groups),
    groups, samples of zero-probability outcomes)."""
    stat, df, tested, groups, impossible = 0.0, 0, 0, 0, 0
    for j in range(positions):
        by_prefix: dict[tuple, Counter] = {}
        for s in samples:
            if len(s) > j and END not in s[:j]:
                by_prefix.setdefault(tuple(s[:j]), Counter())[s[j]] += 1
        for prefix, counts in sorted(by_prefix.items(), key=lambda kv: -sum(kv[1].values())):
            n = sum(counts.values())
            reference = probs(prefix) if n >= MIN_GROUP or j == 0 else None
            if reference is None:
                continue
            s_, d_, bad = goodness_of_fit(counts, reference, complete)
            stat, df, tested, groups, impossible = stat + s_, df + d_, tested + n, groups + 1, impossible + bad
    return stat, df, tested, groups, impossible


def _later(samples: Sequence[tuple], position: int) -> Counter:
    """The outcome at `position` of every sample (END where it ended there or before)."""
    return Counter((s[position] if len(s) > position and END not in s[:position] else END) for s in samples)


def _stat_test(name, setting, n, stat, df, level, n_eff, detail="", impossible=0) -> StatTest:
    stats = _chi2()
    p = float(stats.chi2.sf(stat, df)) if df > 0 else 1.0
    if impossible:
        p = 0.0
        detail = (detail + "; " if detail else "") + f"{impossible} samples the target gives probability 0"
    return StatTest(name, setting, n, stat, df, p, level, detectable_tv(df, level, n_eff), detail)


# -- in-process ------------------------------------------------------------------------------------


def _outcome(result) -> tuple:
    return tuple(result.tokens) + ((END,) if result.stats.finish_reason == "eog" else ())


def sample_outcomes(decoder, prompt_tokens, config: GenerationConfig, rows: int, batch: int, seed: int) -> list[tuple]:
    """`rows` seeded continuations of one prompt (row i seeded seed + i), `batch` rows at a time."""
    out = []
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        out += [_outcome(r) for r in decoder.generate_batch([prompt_tokens] * n, config, seed=seed + start)]
    return out


def target_probs(
    target, prompt_tokens: Sequence[int], params: SamplingParams, tolerance: float = 0.0
) -> Callable[[tuple], dict]:
    """prefix -> the target's next-token distribution after prompt + prefix (processed by
    `params`; END holds the end-of-generation tokens' mass), scored one token at a time as plain
    decoding scores them. A token the filters cut by less than `tolerance` of logit (below the
    lowest kept token's logit: top-k, top-p and min-p all keep the likeliest tokens) is possible,
    with a probability too small to expect (NEAR_CUT): a speculative engine's batched logits may
    carry it across the cut by rounding (ROUNDING_GAP), so one sample of it is no proof of a bug,
    while the chi-square still counts every such sample in its "rest" bin, where many of them
    fail it. Uses one spare row of `target`, kept until the returned function's `close()`."""
    eog = sorted(target.tokenizer.eog_ids)
    [r] = target.add_rows(1)
    base = len(prompt_tokens) - 1
    if base:
        target.forward_rows({r: list(prompt_tokens[:-1])})
    cache: dict[tuple, dict] = {}

    def probs(prefix: tuple) -> dict:
        if prefix not in cache:
            target.rollback_rows({r: base})
            for t in [prompt_tokens[-1], *prefix]:
                row = target.forward_rows({r: [t]}, {r: 1})[r][0]  # [vocab]
            p = logits_to_probs(row, params)  # [vocab]
            if tolerance > 0 and not params.greedy:  # tokens a rounding could carry across the cut
                kept = p > 0
                near = ~kept & (row >= row[kept].min() - tolerance)
                if near.any():
                    p = p.copy()
                    p[near] = NEAR_CUT
            out = {int(t): float(p[t]) for t in np.flatnonzero(p) if int(t) not in target.tokenizer.eog_ids}
            end = float(p[eog].sum()) if eog else 0.0
            if end > 0:
                out[END] = end
            cache[prefix] = out
        return cache[prefix]

    probs.close = lambda: target.drop_rows([r])
    return probs


def check_decoder(
    decoder,
    prompts: Sequence[str] = PROMPTS,
    *,
    greedy_tokens: int = 64,
    samples: int = 1000,
    sample_tokens: int = 4,
    sampled_prompts: int = 1,
    settings: Sequence[SamplingParams] = (SamplingParams(1.0),),
    batch: int = 1,
    seed: int = 0,
    alpha: float = ALPHA,
    chat: bool | None = None,
    engine: str | None = None,
) -> CheckReport:
    """The check of an in-process SpeculativeDecoder: greedy over `prompts` (`greedy_tokens` each;
    the speculative rows `batch` at a time, plain decoding alone), then for each of `settings` on
    the first `sampled_prompts` prompts: `samples` speculative and as many plain continuations of
    `sample_tokens` tokens, tested at every position against the target and at the last position
    against plain (greedy_tokens=0 or samples=0 skips a part)."""
    from .decoder import SpeculativeDecoder

    target = decoder.target
    exact = bool(target.exact)
    report = CheckReport(engine or target.name, alpha, exact)
    plain = SpeculativeDecoder(target, None, max_rows=1)  # greedy reference: alone, one token a step
    plain_rows = SpeculativeDecoder(target, None, max_rows=batch)  # plain samples, as many rows as the drafts
    if greedy_tokens:
        config = GenerationConfig(max_new_tokens=greedy_tokens, chat=chat)
        spec_results = decoder.generate_batch(list(prompts), config)
        for i, (prompt, spec) in enumerate(zip(prompts, spec_results)):
            ref = plain.generate(prompt, config)
            report.greedy_prompts += 1
            if ref.tokens == spec.tokens:
                report.greedy_identical += 1
                continue
            report.partings.append(
                _parting(i, *greedy_parting(target, ref.prompt_tokens, ref.tokens, spec.tokens, exact))
            )
    if not samples:
        report.notes.append("sampled tests skipped (--samples 0)")
        return report
    if sample_tokens <= TWO_SAMPLE_FROM:
        report.notes.append(f"no two-sample test: it reads position {TWO_SAMPLE_FROM} or later (give more tokens)")
    positions = sample_tokens
    tolerance = 0.0 if exact else ROUNDING_GAP  # the exact mode's logits are a plain step's, bit for bit
    n_tests = len(settings) * min(sampled_prompts, len(prompts)) * (1 + (sample_tokens > TWO_SAMPLE_FROM))
    level = alpha / n_tests
    for params in settings:
        config = GenerationConfig(
            max_new_tokens=sample_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            chat=chat,
        )
        for i, prompt in enumerate(prompts[:sampled_prompts]):
            prompt_tokens = decoder.prompt_tokens(prompt, config)
            spec = sample_outcomes(decoder, prompt_tokens, config, samples, batch, seed)
            probs = target_probs(target, prompt_tokens, params, tolerance)
            try:
                stat, df, tested, groups, bad = positions_test(spec, probs, positions)
            finally:
                probs.close()
            report.tests.append(
                _stat_test(
                    f"prompt {i}, positions 0..{positions - 1} vs the target's p",
                    _setting(params),
                    samples,
                    stat,
                    df,
                    level,
                    samples,
                    f"{groups} prefixes, {tested} tokens",
                    bad,
                )
            )
            if sample_tokens > TWO_SAMPLE_FROM:
                ref = sample_outcomes(plain_rows, prompt_tokens, config, samples, batch, seed + samples)
                j = sample_tokens - 1
                stat, df = two_sample(_later(spec, j), _later(ref, j))
                report.tests.append(
                    _stat_test(
                        f"prompt {i}, position {j}: speculative vs plain samples",
                        _setting(params),
                        samples,
                        stat,
                        df,
                        level,
                        samples / 2,
                    )
                )
    return report


# -- a remote engine: any OpenAI-compatible server ------------------------------------------------


@dataclass(frozen=True)
class Completion:
    text: str
    finished: bool  # ended by the model (finish_reason "stop") rather than the token budget
    tokens: tuple | None = None  # each token's bytes, where the server gave logprobs
    logprobs: tuple | None = None  # each token's log-probability, where given
    top: tuple | None = None  # per token: {token bytes: logprob} of the most likely, where given


class Endpoint:
    """One OpenAI-compatible server, through its chat completions (httpx). Every failure is a
    SpecdecError of one line."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 300.0):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SpecdecError(f"{url}: give the http:// or https:// URL of an OpenAI-compatible server")
        try:
            import httpx
        except ImportError:
            raise SpecdecError(
                "checking a server needs httpx: pip install -e '.[check]' (in specdec's checkout)"
            ) from None
        self.url = url
        self.base = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.logprobs: bool | None = None  # whether the server gives them; None: not asked yet
        self.model = model or self._first_model()

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            r = self.client.request(method, self.base + path, json=body)
        except httpx.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise SpecdecError(f"cannot reach {self.url}: {reason}") from None
        if r.status_code >= 400:
            raise _HTTPError(r.status_code, f"{self.base}{path} answered {r.status_code}: {_error_message(r)}")
        try:
            return r.json()
        except ValueError:
            raise SpecdecError(f"{self.base}{path} did not answer JSON; is it an OpenAI-compatible server?") from None

    def _first_model(self) -> str:
        models = self._request("GET", "/v1/models").get("data") or []
        if not models or "id" not in models[0]:
            raise SpecdecError(f"{self.base}/v1/models lists no model; give --model")
        return models[0]["id"]

    def complete(self, prompt: str, max_tokens: int, params: SamplingParams, seed: int | None = None) -> Completion:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": params.temperature,
        }
        # every filter explicitly, off ones too: a server's own defaults (llama-server's top-k 40,
        # top-p 0.95, min-p 0.05) would otherwise filter what the check means to sample unfiltered
        body.update(top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
        if seed is not None:
            body["seed"] = seed
        if self.logprobs is not False:
            try:
                out = self._request("POST", "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 20})
            except _HTTPError as exc:
                if self.logprobs or exc.status != 400:
                    raise
                self.logprobs = False  # refused: go on without
                out = self._request("POST", "/v1/chat/completions", body)
        else:
            out = self._request("POST", "/v1/chat/completions", body)
        try:
            choice = out["choices"][0]
            text = choice["message"]["content"] or ""
            content = (choice.get("logprobs") or {}).get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise SpecdecError(f"{self.base}/v1/chat/completions answered no choice with a message") from None
        if self.logprobs is None:
            self.logprobs = content is not None
        finished = choice.get("finish_reason") == "stop"
        if not content:
            return Completion(text, finished)
        tokens = tuple(_token_key(e) for e in content)
        top = tuple({_token_key(t): float(t["logprob"]) for t in e.get("top_logprobs") or []} for e in content)
        logprobs = tuple(float(e["logprob"]) for e in content)
        return Completion(text, finished, tokens, logprobs, top)


class _HTTPError(SpecdecError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error_message(response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return " ".join(str(message).split())


def _token_key(entry: dict) -> bytes:
    """A token by its bytes (OpenAI's `bytes`; else its text as UTF-8)."""
    data = entry.get("bytes")
    return bytes(data) if data is not None else str(entry.get("token", "")).encode()


def _off_greedy(c: Completion, tie: float, start: int = 0) -> tuple[int, float] | None:
    """The first token from `start` on that is not the server's own top-1 by `tie` or more, as
    (index, the top-1's logprob minus the token's), from its reported log-probabilities."""
    for j in range(start, len(c.tokens)):
        best = max(c.top[j].values(), default=c.logprobs[j])
        if best - c.logprobs[j] >= tie and best > c.logprobs[j]:
            return j, best - c.logprobs[j]
    return None


def _remote_greedy(i: int, s: Completion, p: Completion | None, exact: bool) -> Parting | None:
    """Prompt i's greedy finding for a server: a parting from the plain endpoint's output `p`
    (classed by p's top-2 log-probabilities there), or a speculative token that is not the
    server's own top-1 by ROUNDING_GAP (any margin in the exact mode); None if neither."""
    tie = 0.0 if exact else ROUNDING_GAP
    why = "exact mode: any parting is a bug" if exact else "not a rounding tie"
    first = None
    if p is not None and (s.tokens, s.text) != (p.tokens, p.text):
        if s.tokens is None or p.tokens is None:
            first = first_difference(p.text, s.text)
            return Parting(
                i, first, None, "unknown", f"parts at character {first}: no logprobs to tell a tie from a bug"
            )
        first = first_difference(p.tokens, s.tokens)
        top = sorted(p.top[first].values(), reverse=True)[:2] if first < len(p.tokens) else []
        gap = top[0] - top[1] if len(top) == 2 else None
        if gap is None:
            return Parting(i, first, None, "unknown", f"parts at token {first}; no top-2 log-probabilities there")
        if gap >= tie:
            return Parting(i, first, gap, "bug", f"parts at token {first} where the top-2 gap is {gap:.3f} ({why})")
    off = _off_greedy(s, tie) if s.tokens is not None else None
    if off is not None:
        j, gap = off
        return Parting(
            i,
            j if first is None else first,
            gap,
            "bug",
            f"speculative token {j} is not the server's own top-1 there: {gap:.3f} below it ({why})",
        )
    if first is None:
        return None
    return Parting(
        i,
        first,
        gap,
        "tie",
        f"parts at token {first}, top-2 gap {gap:.4f} < {ROUNDING_GAP}: a rounding tie, greedy after it",
    )


def _remote_outcome(c: Completion, max_tokens: int) -> tuple:
    if c.tokens is None:
        return (c.text,)  # no tokens: the whole text is the outcome
    return c.tokens + ((END,) if c.finished and len(c.tokens) < max_tokens else ())


def _many(endpoint: Endpoint, prompt: str, max_tokens: int, params, n: int, seed: int, workers: int) -> list:
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        return list(pool.map(lambda i: endpoint.complete(prompt, max_tokens, params, seed + i), range(n)))
    except BaseException:  # Ctrl-C or a failed request: drop the queued ones, cut the ones in flight
        pool.shutdown(wait=False, cancel_futures=True)
        endpoint.client.close()
        raise
    finally:
        pool.shutdown(wait=False)


def check_remote(
    url: str,
    plain_url: str | None = None,
    prompts: Sequence[str] = PROMPTS,
    *,
    greedy_tokens: int = 64,
    samples: int = 1000,
    sample_tokens: int = 4,
    sampled_prompts: int = 1,
    settings: Sequence[SamplingParams] = (SamplingParams(1.0),),
    concurrency: int = 4,
    seed: int = 0,
    alpha: float = ALPHA,
    exact: bool = False,
    api_key: str | None = None,
    model: str | None = None,
) -> CheckReport:
    """The check of a server (`url`), against a plain endpoint of the same model (`plain_url`)
    where given. What a server allows:

    - with logprobs (top_logprobs): every position of seeded samples against the server's own
      reported probabilities at that prefix (the logits it verified the speculated tokens with;
      at temperature 1 without filters only: servers report them before temperature and filters);
      a greedy parting's gap from the plain endpoint's top-2 log-probabilities;
    - with `plain_url`: greedy equality, and a two-sample test at the last sampled position (on
      the tokens where logprobs name them, else on the whole sampled text);
    - never: a replay after a tie (no logits).
    Samples are sent `concurrency` at a time."""
    spec = Endpoint(url, api_key, model)
    plain = Endpoint(plain_url, api_key, model or spec.model) if plain_url else None
    report = CheckReport(f"{url} (model {spec.model})" + (f" vs plain {plain_url}" if plain else ""), alpha, exact)
    greedy = SamplingParams(0.0)
    report.greedy_plain = plain is not None
    if plain is None:
        report.notes.append("no --plain-url: greedy equality and the two-sample tests need a plain endpoint")
    if greedy_tokens:
        for i, prompt in enumerate(prompts):
            s = spec.complete(prompt, greedy_tokens, greedy)
            parting = _remote_greedy(i, s, plain.complete(prompt, greedy_tokens, greedy) if plain else None, exact)
            if plain is not None or s.tokens is not None:
                report.greedy_prompts += 1
                report.greedy_identical += parting is None and plain is not None
            if parting is not None:
                report.partings.append(parting)
        if spec.logprobs:
            report.notes.append(
                "greedy: every speculative token checked against the server's own top log-probabilities "
                "at its position (the logits it verified with)"
            )
    if not samples:
        report.notes.append("sampled tests skipped (--samples 0)")
    else:
        _remote_sampled(
            report, spec, plain, prompts, samples, sample_tokens, sampled_prompts, settings, concurrency, seed
        )
    if spec.logprobs is False:
        report.notes.append("the server gives no logprobs: no test against its own probabilities, no gap at a parting")
    if not report.checked:
        raise SpecdecError(
            f"nothing to check at {url}: it gives no logprobs; give --plain-url, a plain endpoint of the same model"
        )
    return report


def _reported(completions: Sequence[Completion]) -> Callable[[tuple], dict | None]:
    """prefix (token bytes) -> the next token's probabilities the server reported there (its top
    log-probabilities at that position of a sample with that prefix: the logits it verified the
    sample's token with; END for a token that prints nothing), or None where no sample says."""
    at: dict[tuple, dict] = {}
    for c in completions:
        for j in range(len(c.tokens or ())):
            at.setdefault(tuple(c.tokens[:j]), c.top[j])

    def probs(prefix: tuple) -> dict | None:
        top = at.get(tuple(prefix))
        if top is None:
            return None
        out = {k: float(np.exp(lp)) for k, lp in top.items()}
        if b"" in out:  # a token that prints nothing: the end of generation, as far as text shows
            out[END] = out.pop(b"")
        return out

    return probs


def _remote_sampled(report, spec, plain, prompts, samples, sample_tokens, sampled_prompts, settings, workers, seed):
    # how many tests: found out after the first answer says whether logprobs come
    plan = []
    for params in settings:
        for i, prompt in enumerate(prompts[:sampled_prompts]):
            s = _many(spec, prompt, sample_tokens, params, samples, seed, workers)
            if s[0].tokens is not None and params == SamplingParams(1.0):  # what the server reports
                plan.append(("p", i, params, s, None))
            if plain is not None:
                ref = _many(plain, prompt, sample_tokens, params, samples, seed + samples, workers)
                plan.append(("two", i, params, s, ref))
    if spec.logprobs and any(p != SamplingParams(1.0) for p in settings):
        report.notes.append(
            "the test against the server's own probabilities runs at temperature 1 without filters only: "
            "servers report log-probabilities before temperature and filters"
        )
    level = report.alpha / max(len(plan), 1)
    for kind, i, params, s, ref in plan:
        if kind == "p":
            outcomes = [_remote_outcome(c, sample_tokens) for c in s]
            stat, df, tested, groups, bad = positions_test(outcomes, _reported(s), sample_tokens, complete=False)
            report.tests.append(
                _stat_test(
                    f"prompt {i}, positions 0..{sample_tokens - 1} vs the server's reported p",
                    _setting(params),
                    len(s),
                    stat,
                    df,
                    level,
                    len(s),
                    f"{groups} prefixes, {tested} tokens: its top {len(s[0].top[0])} log-probabilities "
                    "at each and a rest bin",
                    bad,
                )
            )
        else:
            j = sample_tokens - 1
            if s[0].tokens is not None and ref[0].tokens is not None:
                a = _later([_remote_outcome(c, sample_tokens) for c in s], j)
                b = _later([_remote_outcome(c, sample_tokens) for c in ref], j)
                what = f"position {j}"
            else:
                a, b = Counter(c.text for c in s), Counter(c.text for c in ref)
                what = f"the whole {sample_tokens}-token text (no token ids without logprobs)"
            stat, df = two_sample(a, b)
            report.tests.append(
                _stat_test(
                    f"prompt {i}, {what}: speculative vs plain samples",
                    _setting(params),
                    len(s),
                    stat,
                    df,
                    level,
                    len(s) / 2,
                )
            )
