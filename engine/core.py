"""The engine front: one model, its pools, the gate in front of them: load, admit, status.

``Engine`` owns the gate (``gate.Gate``: every admission, rebuild and stop goes through it),
the served model (``load.ServedModel``), the ``Pools`` (expert slots, KV pages and their
budget), the request registry (``requests.Requests``) and the telemetry, and wires them
together. The HTTP layer calls it; the loading sequence lives in ``load.py``, the requests'
streams in ``requests.py``, the status assembly in ``status.py``, the live re-split and the
stop flows in ``rebuild.py`` and ``stop.py`` (which get the gate, the pools and the requests,
never the engine).

Threads: the server's event loop runs admission, streaming and the flows; the loading
thread runs :meth:`Engine.load`; the batch runner has its generation thread. Gate
transitions and the registry share one lock, so admission is atomic with state changes (a
request is either refused or registered before a rebuild checks for idleness).

May import every engine room below the HTTP layer (``load``, ``pools``, ``requests``,
``status``, ``gate``, ``budget``, ``cb``, ``telemetry``) and ``moetray.policy``; never
``moetray.engine.api`` (except the one error type a bad ``max_tokens`` raises) or the
control operations.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetray.engine.budget import MAX_TOKENS_CEILING
from moetray.engine.cb import BatchRunner, Sampling
from moetray.engine.gate import Gate
from moetray.engine.load import LoadState, ServedModel, load_model
from moetray.engine.pools import Pools
from moetray.engine.requests import EngineUnavailable, RequestRecord, Requests, Step
from moetray.engine.status import health, model_info, snapshot
from moetray.engine.telemetry import Telemetry
from moetray.policy import wire
from moetray.policy.maintenance import GateState, SealedAccounting
from moetray.policy.pool_sizes import DEFAULT_KV_RESERVE_TOKENS, DEFAULT_MEMORY_RATIO
from moetray.policy.rebuild import EngineActivity

if TYPE_CHECKING:
    from moetray.engine.chat import ChatSupport

__all__ = ["Engine", "EngineOptions", "EngineUnavailable", "RequestRecord"]

log = logging.getLogger("moetray.engine")


@dataclass
class EngineOptions:
    """Everything ``moetray serve`` can set; defaults are the documented CLI defaults."""

    model_dir: Path | None  # None: the embedded demo model
    device: str = "auto"
    dtype: str = "auto"
    moe_capacity: int | None = None  # expert slots; None: planned from the budget
    kv_tokens: int | None = None  # None: planned from the budget
    state_slots: int | None = None  # recurrent-state slots (hybrid models); None: planned from the budget
    budget_bytes: int | None = None  # CPU: the device tier's budget; CUDA: overrides the measurement
    memory_ratio: float = DEFAULT_MEMORY_RATIO
    kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS
    page_size: int = 16
    max_batch_tokens: int = 256
    max_requests_per_batch: int = 32
    prefix_policy: str | None = None  # None: cb.choose_prefix_policy decides per model
    top_k: int | None = None
    expert_policy: str | None = None
    link_gbps: float | None = None
    compile_decode: bool = True  # small decode batches' experts run the compiled kernel (experts/fused.py)
    outbox_dir: Path | None = None
    rebuild_idle_timeout_s: float = 30.0
    model_aliases: tuple[str, ...] = ()  # more names /v1/* accepts besides the id, "default", the folder
    accept_any_model: bool = False  # accept any "model" name (clients that hard-code one)
    test_hooks: bool = False
    test_step_delay_s: float = 0.0  # test hook: every batch step sleeps this long (needs test_hooks)
    test_load_delay_s: float = 0.0  # test hook: loading holds this long once the config is read (test_hooks)
    instance_id: str | None = None


class Engine:
    """The engine process's state and verbs (see the module docstring)."""

    def __init__(self, options: EngineOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self.started_at = clock()
        self.started_unix = time.time()
        self.lock = threading.RLock()
        self.gate = Gate(self.lock)
        self.telemetry = Telemetry(clock)
        self.requests = Requests(self.lock, clock, self.telemetry, self._runner, self.model_id)
        self.identity = (
            options.instance_id
            or os.environ.get("MOETRAY_INSTANCE_ID")
            or (f"pid:{os.getpid()}:started:{int(self.started_unix)}")
        )
        self.loading = LoadState()
        self.served: ServedModel | None = None
        self.pools: Pools | None = None

    def _runner(self) -> BatchRunner | None:
        return self.pools.runner if self.pools is not None else None

    # ------------------------------------------------------------------ loading

    def start_loading(self) -> threading.Thread:
        """Load the model on a background thread; the gate ends ``serving`` or ``failed``."""
        thread = threading.Thread(target=self.load, name="moetray-load", daemon=True)
        thread.start()
        return thread

    def load(self) -> None:
        """Read, price, load and start serving; any failure latches the gate ``failed`` with its reason."""
        try:
            self.served, self.pools = load_model(self.options, self.loading)
        except Exception as exc:  # the reason travels to /health; the gate latches
            log.exception("loading failed")
            self.loading.failed(exc)
            self.gate.finish_loading(False)
            return
        state = self.gate.finish_loading(True)
        self.loading.report("ready", 1, 1)
        log.info("engine %s: %s", state.value, self.served.loaded.info.label)

    # ------------------------------------------------------------------ admission

    def chat_support(self) -> ChatSupport:
        """The loaded model's chat support; before a model is loaded, refuses with the gate's state.

        Not the admission check (``admit`` is, atomically with registration): only what
        building a prompt needs.
        """
        if self.served is None or self.pools is None or self.pools.ceiling is None:
            state = self.gate.state.value
            raise EngineUnavailable(state, f"server unavailable: engine is {state}")
        return self.served.chat

    def fit_max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """Granted ``max_tokens`` under the context ceiling (raises ``ContextTooLong``)."""
        ceiling = self.pools.ceiling if self.pools is not None else None
        if ceiling is None:
            raise EngineUnavailable(self.gate.state.value, "the engine is not serving yet")
        if requested is not None and (requested < 1 or requested > MAX_TOKENS_CEILING):
            from moetray.engine.api.errors import ApiError

            raise ApiError(
                "invalid_request_error",
                f"max_tokens must be between 1 and {MAX_TOKENS_CEILING}, got {requested}",
                param="max_tokens",
            )
        return ceiling.fit(prompt_tokens, requested)

    def admit(
        self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling, request_id: str | None = None
    ) -> RequestRecord:
        """Admit one request through the gate and register it; refuses before registering anything.

        Raises ``AdmissionClosed`` (gate not serving) or ``EngineUnavailable`` (the batch
        loop died). ``max_new_tokens`` must already be fitted to the context ceiling.
        """
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.gate.check_admission()
            runner = self._runner()
            if runner is None or not runner.running:
                # The batch loop died under us: nothing can be served any more, say so for good.
                reason = runner.fatal_error if runner is not None else None
                self.gate.latch_failed()
                self.loading.error = self.loading.error or f"the batch loop stopped: {reason}"
                raise EngineUnavailable("failed", f"the batch loop is not running ({reason})")
            return self.requests.register(rid, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling)

    # The request path after admission is the registry's (``requests.Requests``).

    def stream(self, record: RequestRecord, *, every_step: bool = True) -> AsyncGenerator[Step, None]:
        return self.requests.stream(record, every_step=every_step)

    def cancel(self, request_id: str, *, by: str = "admin") -> bool:
        return self.requests.cancel(request_id, by=by)

    def abandon(self, request_id: str) -> None:
        self.requests.abandon(request_id)

    def activity(self) -> EngineActivity:
        return self.requests.activity()

    def active_requests(self) -> list[dict[str, Any]]:
        return self.requests.rows()

    # ------------------------------------------------------------------ status

    @property
    def state(self) -> GateState:
        return self.gate.state

    def model_id(self) -> str | None:
        return self.served.model_id if self.served is not None else None

    def uptime_s(self) -> float:
        return self.clock() - self.started_at

    def sealed_accounting(self) -> SealedAccounting:
        """The totals a stop seals: tokens in and out, and how long this engine ran."""
        t = self.telemetry
        return SealedAccounting(
            model_id=self.model_id(),
            prompt_tokens_total=t.prompt_tokens_total,
            completion_tokens_total=t.completion_tokens_total,
            uptime_seconds=round(self.uptime_s(), 3),
        )

    def health(self) -> wire.Health:
        busy = lambda: not self.requests.activity().is_idle()  # noqa: E731
        return health(self.gate.state.wire_name, self.loading, self.served, self._runner(), busy)

    def model_info(self) -> dict[str, Any] | None:
        return model_info(self.served, self.pools)

    def snapshot(self) -> dict[str, Any]:
        """``policy.wire.StatusSnapshot`` (see ``status.snapshot``)."""
        return snapshot(
            state=self.gate.state.wire_name,
            load=self.loading,
            uptime_s=self.uptime_s(),
            served=self.served,
            pools=self.pools,
            telemetry=self.telemetry,
            requests=self.requests.rows(),
            rebuild_progress=self.gate.resplit.progress() if self.gate.resplit is not None else None,
        )

    def shutdown(self) -> None:
        """Stop the batch loop (process exit); idempotent."""
        if self.pools is not None:
            self.pools.close()
