"""Sampling stages: how each request in a continuous batch picks its next token.

The manager's processor list runs, per step and per row, in this order:

1. penalties and bias (``presence_penalty`` / ``frequency_penalty`` over the tokens the
   request generated so far, OpenAI's definitions; ``logit_bias``: −100 bans, +100 forces,
   anything between is added to the logit);
2. the grammar mask (``grammar.Grammar``: llguidance's token mask for a constrained row);
3. temperature, then top-p;
4. the *draw*: greedy, seeded inverse-CDF sampling, or a forced token (test hook); every
   other logit is masked so the substrate's own greedy sampler emits the choice. Rows that
   asked for log-probabilities get them here, from the distribution the draw used.

Each stage touches only the rows that ask for it. Greedy stays the stock argmax over fp32
logits (token identity with ``generate``), and a step whose rows are all plain greedy skips
the processors entirely (:func:`needs_processors`). Per-request state a stage keeps across
steps (penalty counts, the grammar matcher, the log-probabilities taken) lives in
:class:`RequestStages`, registered by the runner at submit; the substrate's per-request
kwargs only flag which stages a row needs (they are deep-copied on a soft reset).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from moetray.engine.cb.grammar import Grammar, apply_token_bitmask, fill_token_bitmask

_U_SCALE = float(2**31)
BIAS_BAN, BIAS_FORCE = -100.0, 100.0
"""``logit_bias`` values that ban a token outright / allow only the tokens so biased."""
LOGPROB_FLOOR = -9999.0
"""The log-probability reported for a token the distribution excluded (JSON has no −inf)."""


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (the stock argmax). ``seed`` makes sampling repeatable
    per request, independent of what else shares the batch. ``forced_tokens`` is the
    documented **test hook**: the real engine emits exactly these ids, then the first EOS
    id (or greedy when there is none), so tests can drive reasoning / tool-call plumbing
    deterministically through a random-weight model. ``ignore_eos`` (vLLM's extension, for
    benchmarks and load tests) runs to ``max_new_tokens`` whatever the model emits.
    ``logprobs``: None takes none; ``k >= 0`` records each sampled token's log-probability
    and the ``k`` most likely alternatives. ``grammar`` constrains the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    forced_tokens: tuple[int, ...] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def keeps_state(self) -> bool:
        """Whether a stage needs per-request state across steps (see :class:`RequestStages`)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.logprobs is not None
            or self.grammar is not None
        )


class TokenLogprob(NamedTuple):
    """One sampled token's log-probability and the ``k`` most likely tokens of its distribution."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class RequestStages:
    """What the stages keep for one request across steps; fed from its generated tokens.

    ``seen`` generated tokens have been counted (penalties) and consumed (grammar).
    ``logprobs`` grows by one entry per sampled token, appended on the generation thread and
    read on the event loop (list appends and slices are atomic under the GIL).
    """

    sampling: Sampling
    prompt_len: int
    matcher: Any = None  # llguidance.LLMatcher
    counts: Counter = field(default_factory=Counter)
    seen: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def sync(self, state) -> None:
        """Feed the tokens generated since the last step (a soft reset folds them into the prompt)."""
        initial, generated = state.initial_tokens, state.generated_tokens
        start = self.prompt_len + self.seen
        if start >= len(initial):
            new = generated[start - len(initial) :]
        else:
            new = (initial + generated)[start:]
        if not new:
            return
        self.seen += len(new)
        if self.sampling.presence_penalty or self.sampling.frequency_penalty:
            self.counts.update(new)
        if self.matcher is not None and not self.matcher.is_error():
            self.matcher.consume_tokens(list(new))


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


class _Step:
    """This step's rows (one per request with a new token, in logits order) and their stages."""

    def __init__(self) -> None:
        self.stages: list[RequestStages | None] = []
        self.penalised: list[int] = []
        self.constrained: list[int] = []
        self.mask: torch.Tensor | None = None
        self.logprob_rows: list[int] = []

    def of(self, row: int) -> RequestStages:
        """The stages of ``row``; the row lists above name only rows that have some."""
        stages = self.stages[row]
        assert stages is not None, row
        return stages


class _Stage(ContinuousBatchingLogitsProcessor):
    """A stage that reads this step's per-row state instead of a tensor argument."""

    ignored_kwargs = ()

    def __init__(self, step: _Step) -> None:
        self.step = step

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)


class _PenaltyStage(_Stage):
    supported_kwargs = {"presence_penalty": float, "frequency_penalty": float, "logit_bias": list}

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = self.step.penalised
        if not rows:
            return scores
        scores = scores.clone()
        for i in rows:
            stages = self.step.of(i)
            s = stages.sampling
            if stages.counts and (s.presence_penalty or s.frequency_penalty):
                ids = torch.tensor(list(stages.counts.keys()), dtype=torch.long, device=scores.device)
                n = torch.tensor(list(stages.counts.values()), dtype=scores.dtype, device=scores.device)
                scores[i, ids] -= n * s.frequency_penalty + s.presence_penalty
            if s.logit_bias:
                ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.long, device=scores.device)
                bias = torch.tensor([b for _, b in s.logit_bias], dtype=scores.dtype, device=scores.device)
                forced = bias >= BIAS_FORCE
                if bool(forced.any()):  # only the forced tokens stay possible
                    keep = scores[i, ids[forced]].clone()
                    scores[i].fill_(float("-inf"))
                    scores[i, ids[forced]] = keep
                else:
                    scores[i, ids] = torch.where(
                        bias <= BIAS_BAN, torch.full_like(bias, float("-inf")), scores[i, ids] + bias
                    )
        return scores


class _GrammarStage(_Stage):
    supported_kwargs = {"grammar": bool}

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = self.step.constrained
        if not rows:
            return scores
        mask = self.step.mask
        assert mask is not None  # filled whenever a row is constrained
        index = torch.tensor(rows, dtype=torch.long, device=scores.device)
        masked = apply_token_bitmask(scores.index_select(0, index), mask)
        return scores.index_copy(0, index, masked)


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
    and ``>= 0`` for a uniform draw ``code / 2**31`` sampled by inverse CDF. Rows that asked
    for log-probabilities get them from the scores as they arrive here (after penalties,
    bias, the grammar mask, temperature and top-p: the distribution drawn from).
    """

    supported_kwargs = {"seed": int, "forced_tokens": list, "prompt_len": int, "eos": int, "logprobs": int}
    ignored_kwargs = ()

    def __init__(self, step: _Step) -> None:
        self._rng = random.Random()
        self.step = step

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
        forced = (-code - 2).clamp(min=0, max=vocab - 1)
        if not bool((code >= 0).any()):  # greedy and forced rows only: no distribution needed
            choice = torch.where(code == -1, greedy, forced)
        else:
            probs = torch.softmax(scores.float(), dim=-1)
            cdf = probs.cumsum(dim=-1)
            u = (code.clamp(min=0).to(torch.float64) / _U_SCALE).to(cdf.dtype).unsqueeze(-1)
            sampled = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=vocab - 1)
            # A draw landing on a masked (zero-probability) token falls back to the mode.
            sampled = torch.where(probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1) > 0, sampled, greedy)
            choice = torch.where(code >= 0, sampled, torch.where(code == -1, greedy, forced))
        if self.step.logprob_rows:
            self._record_logprobs(scores, choice)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, choice.unsqueeze(-1), 0.0)
        return out

    def _record_logprobs(self, scores: torch.Tensor, choice: torch.Tensor) -> None:
        rows = self.step.logprob_rows
        index = torch.tensor(rows, dtype=torch.long, device=scores.device)
        logp = torch.log_softmax(scores.index_select(0, index).float(), dim=-1)
        chosen = logp.gather(-1, choice.index_select(0, index).unsqueeze(-1)).squeeze(-1).tolist()
        tokens = choice.index_select(0, index).tolist()
        ks = [self.step.of(i).sampling.logprobs or 0 for i in rows]  # set on every logprob row
        k_max = max(ks)
        top_logp, top_tokens = (logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long()))
        top_vals, top_ids = top_logp.tolist(), top_tokens.tolist()
        for j, i in enumerate(rows):
            k = ks[j]
            top = tuple((t, _finite(v)) for t, v in zip(top_ids[j][:k], top_vals[j][:k], strict=True)
                        if v != float("-inf"))
            self.step.of(i).logprobs.append(TokenLogprob(tokens[j], _finite(chosen[j]), top))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


_STAGE_KEYS = ("presence_penalty", "frequency_penalty", "logit_bias", "grammar", "logprobs")


def needs_processors(kwargs: dict[str, Any]) -> bool:
    """Whether a row with these processor kwargs needs our processors to pick its token.

    A greedy row (temperature 0) with no nucleus (top-p 1), no forced tokens, no penalty,
    bias or grammar and no log-probabilities does not: the processors would leave its
    logits as they are (temperature 1.0 for greedy rows, top-p keeping everything) and draw
    the argmax, which is what the substrate's stock greedy sampler picks from the raw fp32
    logits. Every other row does (a greedy row with top-p < 1 included: its argmax is taken
    after the nucleus cut, as it always was).
    """
    if kwargs.get("forced_tokens") is not None:
        return True
    if any(k in kwargs for k in _STAGE_KEYS):
        return True
    return float(kwargs.get("temperature", 1.0)) > 0.0 or float(kwargs.get("top_p", 1.0)) < 1.0


class SamplingProcessors(ContinuousBatchingLogitsProcessorList):
    """Our stages, run only on the steps where some row needs them.

    The substrate calls :meth:`prepare_tensor_args` on the generation thread before every
    forward (batching is synchronous) and reads ``do_processing`` during that forward, so
    the decision made here holds for exactly that step: a step whose rows all pass
    :func:`needs_processors` as false skips the argument tensors and the full-vocab passes
    and goes straight to the stock argmax. ``steps_processed`` / ``steps_skipped`` count
    the two paths; ``masks_computed`` counts grammar masks and ``stage_runs`` the steps each
    processor ran.
    """

    PENALTY, GRAMMAR, TEMPERATURE, TOP_P, DRAW = range(5)
    """Each processor's place in the list (and its row in the argument storage)."""

    def __init__(self) -> None:
        self.step = _Step()
        self.active: list[int] = []
        processors = [
            _PenaltyStage(self.step),
            _GrammarStage(self.step),
            _TemperatureProcessor(),
            _TopPProcessor(),
            _DrawProcessor(self.step),
        ]
        super().__init__(LogitsProcessorList(processors), per_request_processors=False)
        # The substrate counts argument rows only while converting its own warpers.
        self.tensors_required = len(processors)
        self.do_processing = True
        self.steps_processed = 0
        self.steps_skipped = 0
        self.masks_computed = 0
        self.stage_runs = [0] * len(processors)  # steps each processor ran, by its index
        self.requests: dict[str, RequestStages] = {}

    def register(self, request_id: str, sampling: Sampling, prompt_len: int) -> None:
        """Keep stage state for a request that needs it (before it is queued). Mutates ``requests``."""
        if sampling.keeps_state:
            matcher = sampling.grammar.matcher() if sampling.grammar is not None else None
            self.requests[request_id] = RequestStages(sampling, prompt_len, matcher=matcher)

    def release(self, request_id: str) -> None:
        """Forget a finished or cancelled request's stage state (idempotent)."""
        self.requests.pop(request_id, None)

    def logprobs(self, request_id: str) -> list[TokenLogprob] | None:
        stages = self.requests.get(request_id)
        return stages.logprobs if stages is not None and stages.sampling.logprobs is not None else None

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        """Decides (mutating ``do_processing``) whether this step runs the processors; fills args if so."""
        rows = [r for r in requests_in_batch if r.has_new_token]
        needed = any(needs_processors(r.state.logit_processor_kwargs) for r in rows)
        self.do_processing = needed
        if not needed:
            self.steps_skipped += 1
            return arg_storage
        self.steps_processed += 1
        self._prepare_stages(rows)
        self.active = self._active(rows)
        for index in self.active:
            arg = self.logits_processor[index].prepare_tensor_args(rows)
            arg_storage[index, : arg.size(0)] = arg.to(arg_storage.device)
        return arg_storage

    def _active(self, rows) -> list[int]:
        """Which processors this step runs (indices into the list), decided from its rows.

        The penalty and grammar stages run when a row asks for them. Temperature, top-p and
        the draw run only when some row samples, is forced, cuts a nucleus or takes
        log-probabilities: for rows that are all greedy the stock argmax over the (penalised,
        masked) scores picks what the draw would, so a constrained greedy step pays for its
        mask and nothing else.
        """
        step = self.step
        active = []
        if step.penalised:
            active.append(self.PENALTY)
        if step.constrained:
            active.append(self.GRAMMAR)
        kwargs = [r.state.logit_processor_kwargs for r in rows]
        if any(float(k.get("temperature", 1.0)) > 0.0 for k in kwargs):
            active.append(self.TEMPERATURE)
        if any(float(k.get("top_p", 1.0)) < 1.0 for k in kwargs):
            active.append(self.TOP_P)
        draw = (
            step.logprob_rows
            or self.TEMPERATURE in active
            or self.TOP_P in active
            or any(k.get("forced_tokens") is not None for k in kwargs)
        )
        if draw:
            active.append(self.DRAW)
        return active

    def __call__(self, input_ids, scores: torch.Tensor, logits_processor_args: torch.Tensor) -> torch.Tensor:
        """Run this step's active processors in order (see :meth:`_active`)."""
        for index in self.active:
            scores = self.logits_processor[index](scores, logits_processor_args[index])
            self.stage_runs[index] += 1
        return scores

    def _prepare_stages(self, rows) -> None:
        step = self.step
        step.stages = [self.requests.get(r.state.request_id) for r in rows]
        step.penalised, step.constrained, step.logprob_rows, step.mask = [], [], [], None
        matchers, n_vocab = [], 0
        for i, stages in enumerate(step.stages):
            if stages is None:
                continue
            stages.sync(rows[i].state)
            s = stages.sampling
            if s.presence_penalty or s.frequency_penalty or s.logit_bias:
                step.penalised.append(i)
            if stages.matcher is not None and not stages.matcher.is_error():
                step.constrained.append(i)
                matchers.append(stages.matcher)
                assert s.grammar is not None  # a matcher is made only from a grammar
                n_vocab = s.grammar.n_vocab
            if s.logprobs is not None:
                step.logprob_rows.append(i)
        if matchers:
            step.mask = fill_token_bitmask(matchers, n_vocab)
            self.masks_computed += len(matchers)


def sampling_kwargs(sampling: Sampling, *, prompt_len: int, eos: int | None) -> dict[str, Any]:
    """The per-request keyword arguments our processors read (types checked by the substrate).

    A stage's key is present only when the request uses it, so :func:`needs_processors` can
    tell a plain greedy row by its keys.
    """
    kwargs: dict[str, Any] = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p)}
    if sampling.seed is not None:
        kwargs["seed"] = int(sampling.seed)
    if sampling.forced_tokens is not None:
        kwargs["forced_tokens"] = [int(t) for t in sampling.forced_tokens]
        kwargs["prompt_len"] = int(prompt_len)
        if eos is not None:
            kwargs["eos"] = int(eos)
    if sampling.presence_penalty:
        kwargs["presence_penalty"] = float(sampling.presence_penalty)
    if sampling.frequency_penalty:
        kwargs["frequency_penalty"] = float(sampling.frequency_penalty)
    if sampling.logit_bias:
        kwargs["logit_bias"] = [[int(t), float(b)] for t, b in sampling.logit_bias]
    if sampling.grammar is not None:
        kwargs["grammar"] = True
    if sampling.logprobs is not None:
        kwargs["logprobs"] = int(sampling.logprobs)
    return kwargs
