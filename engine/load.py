"""The loading sequence: from ``EngineOptions`` to a served model and its pools.

:func:`load_model` reads the checkpoint (or builds the embedded demo model), decides the
prefix policy, device, dtype and top-k, loads the weights with the experts offloaded,
measures the device budget once, prices the pools (``pools.price_pools``), plans the
start-up split (``PoolBudget.plan``, a pinned ``--moe-capacity`` / ``--kv-tokens`` /
``--state-slots`` kept),
probes the chat template and opens the pools. ``LoadState`` is what ``/health`` says
meanwhile: the stage, and the reason when loading failed.

May import torch, ``moetray.engine.models``, ``moetray.engine.demo``, ``moetray.engine.chat``,
``moetray.engine.budget``, ``moetray.engine.cb``, ``moetray.engine.pools`` and
``moetray.policy``; never the HTTP layer, the engine front or the control operations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetray.engine.cb import choose_prefix_policy
from moetray.engine.cb.compiled_step import decode_step_of, install_decode_step_where_served
from moetray.engine.cb.kv import return_freed_heap
from moetray.engine.pools import Pools, RunnerSettings, price_pools
from moetray.policy import wire
from moetray.policy.pool_budget import reserve_pages
from moetray.policy.pool_sizes import RebuildRequest

if TYPE_CHECKING:
    import torch

    from moetray.engine.chat import ChatSupport
    from moetray.engine.core import EngineOptions
    from moetray.engine.models.checkpoint import LoadedModel

log = logging.getLogger("moetray.engine.load")


class LoadState:
    """Where loading stands, for ``/health``: the stage with its progress, and why it failed."""

    def __init__(self) -> None:
        self.progress: wire.LoadProgress | None = {"stage": "starting", "done": 0, "total": None}
        self.error: str | None = None
        self.error_kind: str | None = None  # the refusal's kind when loading was refused by name

    def report(self, stage: str, done: int, total: int | None) -> None:
        self.progress = {"stage": stage, "done": int(done), "total": None if total is None else int(total)}

    def failed(self, exc: BaseException) -> None:
        """Loading raised ``exc``: a refusal by name keeps its sentence, anything else its type too."""
        self.error_kind = getattr(exc, "kind", None)
        self.error = str(exc) if self.error_kind else f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ServedModel:
    """The loaded checkpoint and what serving it needs beside the pools."""

    loaded: LoadedModel
    chat: ChatSupport
    eos_ids: tuple[int, ...]  # the checkpoint's EOS ids, then the chat template's turn stops
    prefix_policy: str
    decode_step_refused: str | None  # why decode steps were not compiled (None: they were)

    @property
    def model_id(self) -> str:
        return self.loaded.info.model_id

    @property
    def decode_step_reason(self) -> str | None:
        """Why decode steps run eagerly (refused at load, or a compilation that failed); None: compiled."""
        step = decode_step_of(self.loaded.model)
        return self.decode_step_refused if step is None else step.reason

    def info(self, context_length: int | None) -> dict[str, Any]:
        """``policy.wire.ModelInfo``, with the context the pools allow."""
        info = self.loaded.info
        return {
            "id": info.model_id,
            "path": str(info.path),
            "architecture": info.architecture,
            "label": info.label,
            "num_layers": self.loaded.runtime.num_layers,
            "num_experts": info.num_experts,
            "top_k": self.loaded.top_k,
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "weights": self.loaded.format.weights,
            "dtype_reason": self.loaded.format.reason,
            "decode_kernel": self.loaded.runtime.decode_kernel,
            "decode_kernel_reason": self.loaded.runtime.decode_kernel_reason,
            "decode_step": "compiled" if self.decode_step_reason is None else "eager",
            "decode_step_reason": self.decode_step_reason,
            "context_length": info.context_length if context_length is None else context_length,
        }


def keep_decode_attention_planless(device: torch.device) -> bool:
    """On CUDA, turn cuDNN's attention backend off for this process; whether it did.

    cuDNN's fused attention builds an execution plan for each new query and key shape, and every
    decode step brings a new KV length: on an H200 serving the demo's 30-layer twin it spent ~2 ms of
    host time per layer per step (169 ms a step in bfloat16, 72 ms with it off; one run each,
    ``bench/gpu/``). Without it PyTorch picks flash or memory-efficient attention, which plan nothing.
    """
    if device.type != "cuda":
        return False
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def load_model(opts: EngineOptions, state: LoadState) -> tuple[ServedModel, Pools]:
    """Read, price, load and open the pools; raises the checkpoint's or the budget's refusals."""
    import torch

    from moetray.engine.budget import cpu_budget, cuda_budget, cuda_free_bytes
    from moetray.engine.chat import ChatSupport
    from moetray.engine.models import checkpoint as loader

    progress = state.report
    model_dir = opts.model_dir
    if model_dir is None:
        progress("preparing the embedded demo model", 0, None)
        from moetray.engine.demo import ensure_demo_model

        model_dir = ensure_demo_model(progress)
    progress("reading config", 0, None)
    info = loader.inspect_checkpoint(model_dir)
    if opts.test_hooks and opts.test_load_delay_s > 0:  # a load long enough to be seen loading
        time.sleep(opts.test_load_delay_s)
    prefix_policy = choose_prefix_policy(opts.prefix_policy, info.config)
    device = loader.resolve_device(opts.device)
    keep_decode_attention_planless(device)
    fmt = loader.serving_format(opts.dtype, info, device)
    top_k = opts.top_k or info.default_top_k
    if top_k != info.top_k and not info.top_k_adjustable:
        raise loader.CheckpointError(
            "top_k_fixed",
            f"this checkpoint was built for top-{info.top_k}; "
            f"its sidecar says top-k is not adjustable (asked for {top_k})",
        )
    if not 1 <= top_k <= info.num_experts:
        raise loader.CheckpointError("bad_top_k", f"top-k must lie in [1, {info.num_experts}], got {top_k}")
    floor_slots = info.num_experts  # one layer of experts
    baseline_free = cuda_free_bytes(device)[0] if device.type == "cuda" else None
    loaded = loader.load_checkpoint(
        info,
        device=device,
        fmt=fmt,
        capacity=floor_slots,
        top_k=top_k,
        progress=progress,
        link_gbps=opts.link_gbps,
        policy=opts.expert_policy,
        compile_decode=opts.compile_decode,
    )
    runtime = loaded.runtime
    dtype = loaded.dtype  # activations and the KV cache
    if baseline_free is not None:  # a CUDA device, measured before the weights went in
        measured = cuda_budget(
            device,
            baseline_free=baseline_free,
            free_after_weights=cuda_free_bytes(device)[0],
            pools_already_allocated=floor_slots * int(runtime.bytes_per_slot),
            budget_bytes=opts.budget_bytes,
            ratio=opts.memory_ratio,
        )
    else:
        measured = cpu_budget(opts.budget_bytes)
    budget = price_pools(
        loaded.model.config,
        runtime,
        measured,
        page_size=opts.page_size,
        max_batch_tokens=opts.max_batch_tokens,
        dtype=dtype,
    )
    pinned = RebuildRequest(
        moe_slots=opts.moe_capacity,
        kv_pages=None if opts.kv_tokens is None else reserve_pages(opts.kv_tokens, opts.page_size),
        state_slots=opts.state_slots,
    )
    sizes = budget.plan(opts.kv_reserve_tokens, pinned=pinned)
    log.info(
        "pool split: %d expert slots (%d B each), %d KV pages of %d tokens (%d B each), "
        "%d state slots (%d B each); budget %d B (%s)",
        sizes.moe_slots,
        budget.bytes_per_slot,
        sizes.kv_pages,
        opts.page_size,
        budget.bytes_per_page,
        sizes.state_slots,
        budget.bytes_per_state_slot,
        budget.budget_bytes,
        measured.source,
    )
    from moetray.engine.experts.fused import FUSED_MAX_TOKENS

    progress("compiling the decode kernel", 0, None)
    runtime.warm_up()  # before the runner's settings: its decode steps' threads follow the kernel
    step_refused = install_decode_step_where_served(  # compiled by pools.open
        loaded.model, wanted=opts.compile_decode, kernel_serves=runtime.fused is not None,
        max_tokens=FUSED_MAX_TOKENS)
    eos_ids = loader.eos_token_ids(loaded.model, loaded.tokenizer)
    progress("probing the chat template", 0, 1)
    chat = ChatSupport.probe(
        loaded.tokenizer,
        info,
        eos_ids=eos_ids,
        vocab_size=loaded.model.config.get_text_config().vocab_size,
    )
    eos_ids += tuple(t for t in chat.turn_stop_ids if t not in eos_ids)
    thread_budget = torch.get_num_threads()
    runtime.share_threads = thread_budget  # a one-thread prefill's expert groups take the budget
    settings = RunnerSettings(
        page_size=opts.page_size,
        max_batch_tokens=opts.max_batch_tokens,
        max_requests_per_batch=opts.max_requests_per_batch,
        prefix_policy=prefix_policy,
        eos_token_ids=eos_ids,
        anchor_token=chat.anchor_token,
        step_delay_s=opts.test_step_delay_s if opts.test_hooks else 0.0,
        one_thread_small_steps=runtime.fused is not None,  # a lossy format on the compiled kernel
        thread_budget=thread_budget,
    )
    pools = Pools(loaded.model, runtime, budget, measured, settings, trained_context=info.context_length)
    pools.open(sizes, progress)  # freezes the long-lived objects out of the cyclic GC
    # Loading freed what it only needed on the way (dequantized and full-precision copies of the
    # weights, ``--dtype int8``'s float32 staging, the decode kernel's warm-up); glibc keeps freed
    # heap resident for reuse, so hand it back: 113 MiB of the demo's Q8_0 file served as int8,
    # 64-76 MiB of its F16/Q8_0 files served in float32.
    return_freed_heap()
    return ServedModel(loaded, chat, eos_ids, prefix_policy, step_refused), pools
