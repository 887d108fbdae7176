"""Sampling stages: how each request in a continuous batch picks its next token.

Three ``ContinuousBatchingLogitsProcessor`` subclasses installed as the manager's processor
list: per-request temperature and top-p, then a *draw* processor that picks the next token
(greedy, seeded inverse-CDF sampling, or a forced token for the test hook) and masks every
other logit, so the substrate's own greedy sampler emits it. Greedy stays the stock argmax
over fp32 logits (token identity with ``generate``); a step whose rows are all plain greedy
skips the processors entirely (:func:`needs_processors`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

_U_SCALE = float(2**31)


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (the stock argmax). ``seed`` makes sampling repeatable
    per request, independent of what else shares the batch. ``forced_tokens`` is the
    documented **test hook**: the real engine emits exactly these ids, then the first EOS
    id (or greedy when there is none), so tests can drive reasoning / tool-call plumbing
    deterministically through a random-weight model. ``ignore_eos`` (vLLM's extension, for
    benchmarks and load tests) runs to ``max_new_tokens`` whatever the model emits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    forced_tokens: tuple[int, ...] | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, step): batching cannot change it."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ step) / 2.0**64


def _float_args(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device="cpu").view(dtype=torch.int32)


class _TemperatureProcessor(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"temperature": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        temps = []
        for request in requests_with_new_token:
            t = float(request.state.logit_processor_kwargs.get("temperature", 1.0))
            temps.append(t if t > 0.0 else 1.0)  # greedy rows are drawn by argmax, unscaled
        return _float_args(temps)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temps = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        return scores / temps.unsqueeze(-1)


class _TopPProcessor(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"top_p": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return _float_args(
            [float(r.state.logit_processor_kwargs.get("top_p", 1.0)) for r in requests_with_new_token]
        )

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        keep_all = top_p >= 1.0
        if bool(keep_all.all()):  # the common case: no row asks for nucleus sampling
            return scores
        sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - top_p).unsqueeze(-1)
        remove_sorted[..., -1:] = False  # the most likely token always survives
        remove_sorted &= ~keep_all.unsqueeze(-1)
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        return scores.masked_fill(remove, float("-inf"))


class _DrawProcessor(ContinuousBatchingLogitsProcessor):
    """Picks each row's next token and masks all others, so the stock greedy sampler emits it.

    The per-row code is ``-1`` for greedy, ``<= -2`` for a forced token ``-(code + 2)``,
    and ``>= 0`` for a uniform draw ``code / 2**31`` sampled by inverse CDF.
    """

    supported_kwargs = {"seed": int, "forced_tokens": list, "prompt_len": int, "eos": int}
    ignored_kwargs = ()

    def __init__(self) -> None:
        self._rng = random.Random()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def _code(self, state) -> int:
        kwargs = state.logit_processor_kwargs
        step = len(state.initial_tokens) + len(state.generated_tokens)  # invariant under soft resets
        forced = kwargs.get("forced_tokens")
        if forced is not None:
            j = step - kwargs["prompt_len"]
            if j < len(forced):
                return -(int(forced[j]) + 2)
            eos = kwargs.get("eos")
            return -(eos + 2) if eos is not None and eos >= 0 else -1
        temperature = kwargs.get("temperature", 1.0)
        if temperature <= 0.0:
            return -1
        seed = kwargs.get("seed")
        u = seeded_uniform(seed, step) if seed is not None else self._rng.random()
        return min(int(u * _U_SCALE), 2**31 - 1)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return torch.tensor([self._code(r.state) for r in requests_with_new_token], dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        code = tensor_arg[: scores.size(0)].to(torch.int64)
        vocab = scores.size(-1)
        greedy = scores.argmax(dim=-1)
        if not bool((code >= 0).any()):  # greedy and forced rows only: no distribution needed
            choice = torch.where(code == -1, greedy, (-code - 2).clamp(min=0, max=vocab - 1))
            return torch.full_like(scores, float("-inf")).scatter_(-1, choice.unsqueeze(-1), 0.0)
        probs = torch.softmax(scores.float(), dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = (code.clamp(min=0).to(torch.float64) / _U_SCALE).to(cdf.dtype).unsqueeze(-1)
        sampled = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=vocab - 1)
        # A draw landing on a masked (zero-probability) token falls back to the mode.
        sampled = torch.where(probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1) > 0, sampled, greedy)
        forced = (-code - 2).clamp(min=0, max=vocab - 1)
        choice = torch.where(code >= 0, sampled, torch.where(code == -1, greedy, forced))
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, choice.unsqueeze(-1), 0.0)
        return out


def needs_processors(kwargs: dict[str, Any]) -> bool:
    """Whether a row with these processor kwargs needs our processors to pick its token.

    A greedy row (temperature 0) with no nucleus (top-p 1) and no forced tokens does not:
    the processors would leave its logits as they are (temperature 1.0 for greedy rows,
    top-p keeping everything) and draw the argmax, which is what the substrate's stock
    greedy sampler picks from the raw fp32 logits. Every other row does (a greedy row with
    top-p < 1 included: its argmax is taken after the nucleus cut, as it always was).
    """
    if kwargs.get("forced_tokens") is not None:
        return True
    return float(kwargs.get("temperature", 1.0)) > 0.0 or float(kwargs.get("top_p", 1.0)) < 1.0


class SamplingProcessors(ContinuousBatchingLogitsProcessorList):
    """Our three processors, run only on the steps where some row needs them.

    The substrate calls :meth:`prepare_tensor_args` on the generation thread before every
    forward (batching is synchronous) and reads ``do_processing`` during that forward, so
    the decision made here holds for exactly that step: a step whose rows all pass
    :func:`needs_processors` as false skips the argument tensors and the four full-vocab
    passes (temperature, top-p check, argmax, mask) and goes straight to the stock argmax.
    ``steps_processed`` / ``steps_skipped`` count the two paths.
    """

    def __init__(self) -> None:
        processors = [_TemperatureProcessor(), _TopPProcessor(), _DrawProcessor()]
        super().__init__(LogitsProcessorList(processors), per_request_processors=False)
        # The substrate counts argument rows only while converting its own warpers.
        self.tensors_required = len(processors)
        self.do_processing = True
        self.steps_processed = 0
        self.steps_skipped = 0

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        """Decides (mutating ``do_processing``) whether this step runs the processors; fills args if so."""
        needed = any(
            needs_processors(r.state.logit_processor_kwargs) for r in requests_in_batch if r.has_new_token
        )
        self.do_processing = needed
        if not needed:
            self.steps_skipped += 1
            return arg_storage
        self.steps_processed += 1
        return super().prepare_tensor_args(requests_in_batch, arg_storage)


def sampling_kwargs(sampling: Sampling, *, prompt_len: int, eos: int | None) -> dict[str, Any]:
    """The per-request keyword arguments our processors read (types checked by the substrate)."""
    kwargs: dict[str, Any] = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p)}
    if sampling.seed is not None:
        kwargs["seed"] = int(sampling.seed)
    if sampling.forced_tokens is not None:
        kwargs["forced_tokens"] = [int(t) for t in sampling.forced_tokens]
        kwargs["prompt_len"] = int(prompt_len)
        if eos is not None:
            kwargs["eos"] = int(eos)
    return kwargs
