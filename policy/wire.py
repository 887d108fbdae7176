"""The engine's HTTP contract, described once for its writer (engine/) and reader (app/, ui/).

Decides which HTTP status and retry class every named refusal maps to, and fixes the
route table, the auth header names and the JSON shape of the telemetry snapshot. The
engine builds its routes and error bodies from this module; the tray's client builds its
URLs and reads its fields from it. A second copy of any of these facts is a bug.

Unknown numbers in a snapshot are ``None`` (JSON ``null``), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, NotRequired, TypedDict

ADMIN_TOKEN_ENV = "MOETRAY_ADMIN_TOKEN"
"""Environment variable the tray uses to hand the engine its per-launch admin token."""
ADMIN_TOKEN_FILE_ENV = "MOETRAY_ADMIN_TOKEN_FILE"
"""Environment variable naming a 0600 file that holds the admin token (alternative hand-over)."""
API_KEY_ENV = "MOETRAY_API_KEY"
"""Environment variable holding the key `/v1/*` requires (mandatory for a non-loopback bind)."""
PARENT_PID_ENV = "MOETRAY_PARENT_PID"
"""Environment variable naming the tray that started the engine: the engine ends when it dies."""


def interrupted_by(parent_pid: str | None) -> str:
    """Who a SIGINT to the engine comes from: its tray's Stop (``PARENT_PID_ENV`` set) or Ctrl-C."""
    return f"the tray (pid {parent_pid})" if parent_pid else "Ctrl-C"


def is_a_stop(exc: BaseException) -> bool:
    """Whether ``exc`` is a Stop (``KeyboardInterrupt``) or was raised because of one: Python 3.11
    wraps an exception raised in a descriptor's ``__set_name__`` (a class body, often while a
    module imports) in a ``RuntimeError``, so a Stop landing there reaches the engine's entry
    point as that error, its cause the interrupt."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


EVENTS_INTERVAL_S = 1.0
"""Cadence of `GET /admin/events`: one snapshot per interval."""
SNAPSHOT_EVENT = "status"
"""SSE event name carrying one status snapshot as JSON."""


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    auth: Literal["none", "api_key", "admin"]


ROUTES: dict[str, Route] = {
    "health": Route("GET", "/health", "none"),
    "models": Route("GET", "/v1/models", "api_key"),
    "chat_completions": Route("POST", "/v1/chat/completions", "api_key"),
    "completions": Route("POST", "/v1/completions", "api_key"),
    "model": Route("GET", "/v1/models/{model}", "api_key"),
    "responses": Route("POST", "/v1/responses", "api_key"),
    "status": Route("GET", "/admin/status", "admin"),
    "events": Route("GET", "/admin/events", "admin"),
    "rebuild": Route("POST", "/admin/cache/rebuild", "admin"),
    "rebuild_stop_running": Route("POST", "/admin/cache/rebuild/stop-running", "admin"),
    "rebuild_cancel": Route("POST", "/admin/cache/rebuild/cancel", "admin"),
    "requests": Route("GET", "/admin/requests", "admin"),
    "request_history": Route("GET", "/admin/requests/history", "admin"),
    "cancel": Route("POST", "/admin/requests/{request_id}/cancel", "admin"),
    "prepare_stop": Route("POST", "/admin/prepare-stop", "admin"),
}


PROMPT_PARAMS: dict[str, str] = {
    ROUTES["chat_completions"].path: "messages",
    ROUTES["completions"].path: "prompt",
    ROUTES["responses"].path: "input",
}
"""The body field that holds the prompt, per generation route: the ``param`` of a refusal of the
prompt itself (``context_length_exceeded``), as OpenAI names it."""


def route_path(name: str, **params: str) -> str:
    """The concrete path of route ``name`` with its placeholders filled."""
    return ROUTES[name].path.format(**params)


class Retry(StrEnum):
    """Which kind of no a refusal is: the client's next move."""

    NOW = "now"  # transient: the same call will succeed shortly (Retry-After is set)
    LATER = "later"  # wait for a state change (loading to finish, a restart)
    NEVER = "never"  # the request itself is wrong or the engine cannot recover


@dataclass(frozen=True)
class Refusal:
    status: int
    retry: Retry
    summary: str  # one sentence the UI can show as-is


REFUSALS: dict[str, Refusal] = {
    # Admission (`AdmissionClosed.kind` is the gate state's value).
    "loading": Refusal(503, Retry.LATER, "The model is still loading."),
    "rebuilding": Refusal(503, Retry.NOW, "The memory pools are being re-split; retry in a moment."),
    "stopping": Refusal(503, Retry.NEVER, "The engine is stopping."),
    # New work or a re-split asked of a stopping or stopped engine: nothing will succeed there.
    "engine_stopping": Refusal(409, Retry.NEVER, "The engine is stopping; start it again for new work."),
    "failed": Refusal(503, Retry.NEVER, "The engine failed and must be restarted."),
    # Rebuild gate (`RebuildRefused.kind`) and arithmetic (`RebuildRejected.kind`).
    "not_ready": Refusal(503, Retry.LATER, "The engine is not serving yet."),
    "latched": Refusal(503, Retry.NEVER, "The engine is latched failed; restart it."),
    "busy": Refusal(409, Retry.NOW, "Another change is in progress or requests are running."),
    "below_floor": Refusal(400, Retry.NEVER, "That pool size is below its minimum."),
    "no_such_pool": Refusal(400, Retry.NEVER, "This model has no such pool."),
    "too_large": Refusal(400, Retry.NEVER, "Those pool sizes do not fit in the memory budget."),
    "idle_timeout": Refusal(503, Retry.NOW, "Requests were still running at the deadline; nothing changed."),
    "rebuild_cancelled": Refusal(409, Retry.NEVER, "The re-split was cancelled; nothing changed."),
    "not_waiting": Refusal(409, Retry.NEVER, "No re-split is waiting for running requests."),
    "rebuild_timed_out": Refusal(503, Retry.LATER, "The re-split is still running; it settles on its own."),
    # Rebuild outcomes that are not success.
    "rejected_intact": Refusal(409, Retry.LATER, "The re-split failed before any pool was freed."),
    "rolled_back": Refusal(409, Retry.NOW, "The re-split failed and the old sizes were restored."),
    "rebuild_latched": Refusal(500, Retry.NEVER, "The re-split and its rollback failed; restart the engine."),
    # Stop (`StopRefused.kind`, `StopFailure.kind`).
    "rebuild_in_progress": Refusal(503, Retry.NOW, "A re-split is running; stop again when it ends."),
    "abort_barrier_timed_out": Refusal(503, Retry.NOW, "Requests are still finishing; stop again."),
    "unidentified_inflight": Refusal(503, Retry.NOW, "Unidentified work is in flight; stop again."),
    "not_persisted": Refusal(500, Retry.NOW, "The stop receipt could not be written; stop again."),
    "not_signalled": Refusal(500, Retry.NEVER, "The stop receipt is durable but the reply failed."),
    # Request validation and access.
    "invalid_request_error": Refusal(400, Retry.NEVER, "The request is malformed."),
    "context_length_exceeded": Refusal(400, Retry.NEVER, "The prompt is longer than the context."),
    "not_found": Refusal(404, Retry.NEVER, "No such object."),
    "model_not_found": Refusal(404, Retry.NEVER, "This engine does not serve that model."),
    "unsupported_content": Refusal(400, Retry.NEVER, "The model reads text only (no images or audio)."),
    "invalid_schema": Refusal(400, Retry.NEVER, "The JSON schema cannot be enforced."),
    "tools_unsupported": Refusal(400, Retry.NEVER, "This model's tool-call format is unknown."),
    "constrained_decoding_unavailable": Refusal(
        400, Retry.NEVER, "Constrained decoding cannot read this model's tokenizer."
    ),
    "unsupported_parameter": Refusal(400, Retry.NEVER, "This engine does not support that parameter."),
    "unauthorized": Refusal(401, Retry.NEVER, "Missing or wrong credentials."),
    "forbidden_host": Refusal(403, Retry.NEVER, "Unknown Host header (DNS rebinding guard)."),
    "method_not_allowed": Refusal(405, Retry.NEVER, "That route does not take this method."),
    "request_too_large": Refusal(413, Retry.NEVER, "The request body is larger than this engine accepts."),
    "unsupported_media_type": Refusal(415, Retry.NEVER, "Request bodies must be JSON (application/json)."),
    "internal_error": Refusal(500, Retry.NEVER, "Internal error; the log has its id."),
}

# Loading a model: the ``error_kind`` of a failed load in `/health`, and a listed model's ``refusal``.
REFUSALS.update({
    "not_moe": Refusal(422, Retry.NEVER, "A dense model; moetray serves mixture-of-experts models."),
    "unsupported_quant_type": Refusal(422, Retry.NEVER, "A tensor type moetray cannot decode."),
    "unreadable_checkpoint": Refusal(422, Retry.NEVER, "Model files truncated, corrupt or incomplete."),
    "quantized_checkpoint": Refusal(422, Retry.NEVER, "GPTQ, AWQ and bitsandbytes are not served."),
    "unsupported_family": Refusal(422, Retry.NEVER, "moetray cannot serve this model family yet."),
    "not_a_checkpoint": Refusal(404, Retry.NEVER, "No model there."),
})

RETRY_AFTER_S = 1
"""`Retry-After` seconds sent with every `Retry.NOW` refusal."""
RETRY_AFTER_LATER_S: dict[str, int] = {"loading": 2, "not_ready": 2}
"""`Retry-After` seconds for the `Retry.LATER` refusals whose state change is worth polling for
(the model finishing its load); other `later` refusals wait for something a poll cannot hurry."""

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""Largest request body `moetray serve` reads (`--max-body-bytes`); larger ones are 413 before parsing."""

TIMEOUT_LIMITS_S: dict[str, tuple[float, float]] = {
    "idle_timeout_s": (0.0, 3600.0),  # rebuild: wait for running requests (0: do not wait)
    "txn_timeout_s": (1.0, 3600.0),  # rebuild: wait for the destructive step's outcome
    "drain_timeout_s": (0.0, 3600.0),  # prepare-stop: let running requests finish
    "abort_timeout_s": (0.5, 600.0),  # prepare-stop: wait for aborted requests to let go
}
"""(minimum, maximum) seconds of every client-supplied timeout; outside them the request is a 400."""


def retry_after_s(kind: str) -> int | None:
    """The `Retry-After` seconds a refusal of ``kind`` carries, or None (no header): every
    ``now`` refusal, and the ``later`` ones named in ``RETRY_AFTER_LATER_S``."""
    refusal = refusal_for(kind)
    if refusal.retry is Retry.NOW:
        return RETRY_AFTER_S
    if refusal.retry is Retry.LATER:
        return RETRY_AFTER_LATER_S.get(kind)
    return None


def refusal_for(kind: str) -> Refusal:
    """The status and retry class for a refusal kind; an unknown kind is a 500 that never retries.

    Mutates nothing. An unmapped kind is a programming error surfaced as an internal
    error rather than a guess at a friendlier status.
    """
    return REFUSALS.get(kind, Refusal(500, Retry.NEVER, "Internal error."))


OPENAI_ERROR_TYPES: dict[int, str] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
"""OpenAI's error ``type`` by status; any other 4xx is ``invalid_request_error``, any 5xx ``server_error``."""

GENERIC_KINDS = frozenset({"invalid_request_error"})
"""Kinds that say no more than the status does: their OpenAI ``code`` is null."""


def openai_error_type(status: int) -> str:
    """The ``type`` an OpenAI client expects for an error with this HTTP status."""
    if status >= 500:
        return "server_error"
    return OPENAI_ERROR_TYPES.get(status, "invalid_request_error")


def error_body(kind: str, message: str, **extra: object) -> dict[str, object]:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, plus moetray's own.

    ``type`` is OpenAI's class for the status (``invalid_request_error``, ``server_error``, …),
    ``code`` the refusal's kind as a string (null for a generic bad request), ``param`` the
    offending field or null. moetray adds ``kind`` (the refusal's snake_case name) and
    ``retry`` (now / later / never); ``extra`` fields (``param`` among them) are merged in.
    """
    refusal = refusal_for(kind)
    error: dict[str, object] = {
        "message": message,
        "type": openai_error_type(refusal.status),
        "param": None,
        "code": None if kind in GENERIC_KINDS else kind,
        "kind": kind,
        "retry": refusal.retry.value,
    }
    error.update(extra)
    return {"error": error}


# --- telemetry snapshot (`GET /admin/status`, each `/admin/events` event) -------------

GateStateName = Literal["loading", "serving", "rebuilding", "stopping", "failed"]
RebuildOutcomeName = Literal["applied", "rejected_intact", "rolled_back", "latched"]


class LoadProgress(TypedDict):
    stage: str  # e.g. "reading config", "loading weights", "building expert store"
    done: int
    total: int | None


class Heartbeat(TypedDict):
    """The batch loop's pulse: a busy engine whose steps advance is slow, not hung."""

    steps: int  # batch steps taken since the KV pool was (re)built
    age_s: float | None  # seconds since the latest step; None before the first
    busy: bool  # requests are in flight (an idle loop takes no steps and is not hung)


class Health(TypedDict, total=False):
    """``GET /health`` (no auth): the one route that answers while the model loads."""

    state: GateStateName
    load_progress: LoadProgress | None
    error: str  # why the engine failed; present once it has
    error_kind: str | None  # that failure's snake_case kind when it was a refusal by name
    model: str  # the served model's id, once loaded
    heartbeat: Heartbeat  # present once the batch loop runs


class ModelInfo(TypedDict):
    id: str
    path: str
    architecture: str  # transformers class name, e.g. "Qwen2MoeForCausalLM"
    label: str  # what the UI shows, e.g. "converted dense model (MoEfied), not a trained MoE"
    num_layers: int
    num_experts: int
    top_k: int
    dtype: str  # activations and KV cache: "float32" | "bfloat16" | "float16"
    weights: str  # "float32" | "bfloat16" | "float16" | "int8" (policy.precision.ServingFormat)
    dtype_reason: str  # why: "--dtype …" or what auto saw ("auto: the checkpoint's bfloat16, computed …")
    decode_kernel: str  # a small decode batch's experts: "compiled" (engine/experts/fused.py) or the
    # grouped path's compute mode ("grouped_mm", "eager")
    decode_kernel_reason: str | None  # why not compiled; None when compiled
    decode_step: str  # a decode step's whole decoder: "compiled" (engine/cb/compiled_step.py) or "eager"
    decode_step_reason: str | None  # why eager; None when compiled
    context_length: int | None


class DeviceMemory(TypedDict):
    kind: Literal["cuda", "cpu"]
    name: str
    label: str  # "CPU device tier: host RAM budget" on a machine without a GPU
    total_bytes: int | None
    engine_bytes: int | None
    others_bytes: int | None
    budget_bytes: int | None


class PoolInfo(TypedDict):
    moe_slots: int
    kv_pages: int
    page_size: int  # tokens per KV page
    kv_tokens: int
    state_slots: int  # recurrent-state slots (hybrid models); 0 when the model has no such pool
    bytes_per_slot: int
    bytes_per_page: int
    bytes_per_state_slot: int  # one request's conv + recurrent states over every linear layer; 0 without
    budget_bytes: int
    fixed_bytes: int
    floors: dict[str, int]  # {"moe_slots", "kv_pages", "state_slots"}
    limits: dict[str, dict[str, int]]  # {"moe_slots": {"min", "max"}, "kv_pages": …, "state_slots": …}
    kv_pages_used: int | None  # excludes evictable prefix pages
    kv_pages_evictable: int | None
    state_slots_used: int | None  # live requests + locked snapshots (evictable snapshots excluded)
    live_bytes: dict[str, int | None]  # {"moe_slots", "kv_pages", "state_slots"}: bytes each live pool holds


class ExpertStats(TypedDict):
    residency: list[list[int | None]]  # [layer][expert] → slot, or None when not resident
    recency: list[list[int | None]]  # [layer][expert] → steps since last use, None if never
    window_hits: list[int]  # per layer, over the sliding window
    window_misses: list[int]
    window_bytes: list[int]
    total_hits: int
    total_misses: int
    total_bytes: int
    hit_rate: float | None  # over the window; None before any routing
    bytes_per_token: float | None
    backend: Literal["offload", "hybrid"]
    fetch_fraction: float | None  # q*: share of misses fetched, None when offload-only
    expert_store_bytes: int  # host bytes the expert store holds (quantized blocks stay quantized)
    expert_store_format: str  # what experts are stored as: "F32", "BF16", "Q4_K+Q6_K", "MXFP4+BF16", …


class Throughput(TypedDict):
    tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    queue: int
    requests_served: int
    prompt_tokens_total: int
    completion_tokens_total: int


class ActiveRequest(TypedDict):
    id: str
    state: Literal["queued", "prefill", "decode"]
    tokens: int  # generated so far
    prompt_tokens: int
    age_s: float


class Footprint(TypedDict):
    bytes: int
    kind: Literal["pss", "rss"]


class PoolSizesBody(TypedDict):
    moe_slots: int
    kv_pages: int
    kv_tokens: int
    state_slots: int


class RebuildResult(TypedDict):
    """What `POST /admin/cache/rebuild` reports, and what the dashboard shows verbatim.

    200 when ``outcome`` is ``"applied"``. Any other outcome is an error body
    (``error_body(kind, message, **result)``) carrying these same fields inside ``error``,
    so a refusal still says what the sizes are now. ``after`` equals ``before`` unless
    the change was applied. Durations are wall time: ``elapsed_ms`` the whole call,
    ``waited_ms`` waiting for running requests, ``applied_ms`` changing the pools (``None``
    when that step never ran).
    """

    outcome: RebuildOutcomeName
    before: PoolSizesBody
    after: PoolSizesBody
    prefix_cache_invalidated: bool
    elapsed_ms: float
    waited_ms: float
    applied_ms: float | None


class RebuildProgress(TypedDict):
    """A re-split in progress (``StatusSnapshot.rebuild_progress``): what it waits for.

    ``stage`` is ``waiting`` (for ``running`` requests to finish, ``waited_s`` of at most
    ``timeout_s`` so far) or ``applying``; ``held`` counts requests that arrived meanwhile
    and wait for the gate to reopen.
    """

    stage: Literal["waiting", "applying"]
    running: int
    waited_s: float
    timeout_s: float
    held: int


class FinishedRequest(TypedDict):
    """One row of `GET /admin/requests/history` (``{"requests": [...], "capacity": N}``, newest first).

    ``finished_at`` is seconds since the epoch; ``ttft_ms`` and ``tok_s`` (decode speed after
    the first token) are ``None`` when unknown (no token, or one). ``finish_reason`` is
    ``stop`` / ``length`` / ``cancelled`` / ``error``; ``stopped_by`` says who ended it early:
    ``client`` (went away), ``admin`` (a Stop: dashboard or API), ``stop`` (the engine
    stopping), ``resplit`` (Stop them and apply), or ``None`` when it ran to its end.
    """

    id: str
    finished_at: float
    model: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tok_s: float | None
    finish_reason: str
    stopped_by: str | None


REQUEST_HISTORY = 200
"""How many finished requests the engine keeps for `GET /admin/requests/history`."""


class StatusSnapshot(TypedDict):
    state: GateStateName
    load_progress: LoadProgress | None
    uptime_s: float
    model: ModelInfo | None
    device: DeviceMemory | None
    pools: PoolInfo | None
    experts: ExpertStats | None
    throughput: Throughput
    requests: list[ActiveRequest]
    footprint: Footprint | None  # the engine process; None where unmeasurable
    last_rebuild: NotRequired[RebuildResult | None]  # the last rebuild's result
    rebuild_progress: NotRequired[RebuildProgress | None]  # a re-split under way, else None


# --- local models (`moetray models --json`: one object per model found on disk) --------

ModelSource = Literal["huggingface", "lmstudio", "ollama", "recent", "demo"]
ModelFormat = Literal["safetensors", "gguf"]


class LocalModel(TypedDict):
    """One model already on this machine, as ``moetray models --json`` lists it (the tray's Model
    menu reads this). ``name`` is what ``moetray serve --model`` accepts: ``hf:ORG/NAME``,
    ``ollama:NAME:TAG``, ``lmstudio:PUBLISHER/FOLDER/FILE.gguf``, ``demo``, or a path for a recent
    folder. Unknown facts are null; ``refusal`` is the kind (a ``REFUSALS`` key) that keeps a model
    from being served, null when ``servable``."""

    name: str
    source: ModelSource
    path: str
    format: ModelFormat
    family: str | None  # transformers model type or GGUF architecture, e.g. "qwen3_moe", "qwen3moe"
    moe: bool | None
    bytes: int | None
    servable: bool
    refusal: str | None


LOCAL_MODEL_KEYS = tuple(LocalModel.__annotations__)
"""The keys of every ``moetray models --json`` row, in order."""
