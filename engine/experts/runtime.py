"""The offloading experts runtime: plan, copy, compute, count, once per MoE layer call.

:func:`moetray_experts_forward` is registered in transformers' experts interface as
``"moetray"`` (:func:`register`) and selected with
``model.set_experts_implementation("moetray")``; transformers calls it with the routing
already computed, from ``generate`` and from continuous batching alike. For each call it:

1. lists the distinct routed experts in ascending id order (one host read of the routing);
2. asks :class:`~moetray.policy.moe.qstar.QStarPolicy` how many of this call's misses to
   fetch (hybrid backend only) and :meth:`ExpertCache.ensure
   <moetray.policy.moe.expert_cache.ExpertCache.ensure>` where each routed expert is computed;
3. has :class:`~moetray.policy.moe.expert_slots.ExpertSlots` copy the misses from the host
   store into the slot pool (validated whole before any write);
4. computes every routed expert from its slot, or from the host store when the plan sent it
   to the CPU, with the arithmetic of one stock implementation (``compute``, below; the
   grouped path's GEMMs live in :mod:`moetray.engine.experts.grouped`);
5. records per-layer hits, misses and bytes moved over a sliding window and in total.

Two compute modes, each bit-identical in fp32 (on the CPU) to the stock implementation it
is named after, with every expert resident, at any capacity: the same tensors meet the same
kernels in the same order; only where the weight bytes are read from differs.

- ``"grouped_mm"`` (default; transformers' own default, which ``from_pretrained`` and
  ``transformers serve`` run): token-expert pairs sorted by expert as the stock path sorts
  them, one ``mm`` per routed expert's group of rows into a grouped output (the per-group
  calls PyTorch's grouped-mm kernel makes, minus the empty groups of unrouted experts), then
  gate, routing weights, un-permutation and the sum over top-k as whole-batch ops. Python
  work per call is a handful of ops plus one small call per routed expert and projection.
  Small groups (a short prefill's, a batched decode's) are shared out over the engine's budget.
- ``"eager"``: the stock eager loop's op sequence per expert (``linear`` → gate → ``linear``
  → × routing weight → ``index_add_``), ascending ids; for a one-token call the eager loop's
  mask-and-gather reduces to slicing row 0, which selects the same values.

(On CUDA, an expert the plan sends to the CPU is computed by the CPU's kernels and is then
only close, not bit-equal.)

Costs to know: listing the routed experts reads the routing on the host (``tolist``), so on
CUDA every MoE layer call has one device→host sync; planning is Python per call (see
``ExpertCache``'s policies for their cost). Neither is CUDA-graph-capturable.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moetray.engine.experts.eager import eager_expert, select_rows
from moetray.engine.experts.fused import FUSED_MAX_TOKENS, FusedExperts, compile_kernel, fused_refusal
from moetray.engine.experts.grouped import Operands, grouped_output, operands, project
from moetray.engine.experts.hf import ExpertsModule, padded_grouped_output, register_experts_function
from moetray.engine.experts.int8 import Int8ExpertStore, Int8Weight, int8_gemm
from moetray.engine.experts.opaque import experts_op
from moetray.engine.experts.opaque import register as register_op_key
from moetray.engine.experts.resident import ResidentSlots
from moetray.engine.experts.slots import LinkThrottle, SlotPool, TorchSlotDevice
from moetray.engine.experts.store import ExpertStore, unpack_row
from moetray.policy.moe.expert_cache import DEFAULT_POLICY, CacheIntegrityError, CacheRefused, ExpertCache
from moetray.policy.moe.expert_slots import ExpertSlots, SlotDeviceError
from moetray.policy.refused import Refused

__all__ = ["COMPUTE_MODES", "DEFAULT_COMPUTE", "IMPLEMENTATION_NAME", "ExpertRuntime", "ResizeFault",
           "UnknownComputeMode", "check_compute", "moetray_experts_forward", "register", "runtimes_in"]

log = logging.getLogger(__name__)

IMPLEMENTATION_NAME = "moetray"
"""The name this runtime is registered under in transformers' experts interface."""

COMPUTE_MODES = ("grouped_mm", "eager")
"""The stock experts implementations whose arithmetic the runtime reproduces (``compute=``)."""
DEFAULT_COMPUTE = "grouped_mm"
"""transformers' own default experts implementation, and the faster of the two on batched steps."""

MODULE_ATTRIBUTE_PREFIX = "_moetray"
"""The prefix of the attributes :func:`attach` sets on an experts module (its runtime, its layer):
the only module state a rebuild rebinds, so the compiled decode step keeps their guards."""
_RUNTIME_ATTR = f"{MODULE_ATTRIBUTE_PREFIX}_runtime"
_LAYER_ATTR = f"{MODULE_ATTRIBUTE_PREFIX}_layer"


class UnknownComputeMode(Refused, ValueError):
    """A ``compute`` mode that is not one of :data:`COMPUTE_MODES` (``kind``: ``unknown_compute_mode``)."""

    KINDS = ("unknown_compute_mode",)

    def __init__(self, message: str) -> None:
        super().__init__("unknown_compute_mode", message)


def check_compute(compute: str | None) -> str:
    """The compute mode ``compute`` names (None: :data:`DEFAULT_COMPUTE`); refuses an unknown
    one with :class:`UnknownComputeMode`. Pure."""
    mode = compute or DEFAULT_COMPUTE
    if mode not in COMPUTE_MODES:
        raise UnknownComputeMode(f"unknown compute mode {compute!r}; one of {', '.join(COMPUTE_MODES)}")
    return mode


class ResizeFault(Refused, RuntimeError):
    """A resize that failed; ``kind`` is ``allocation_failed`` (before teardown, nothing
    changed) or ``injected_after_teardown`` (a test fault; the runtime kept its old pool)."""

    KINDS = ("allocation_failed", "injected_after_teardown")
    torn_down: bool  # whether the old pool was already released (set by ``Refused``)

    def __init__(self, kind: str, message: str, *, torn_down: bool) -> None:
        super().__init__(kind, message, torn_down=torn_down)


class ExpertRuntime:
    """One model's offloaded experts: host store, slot pool, planner, executor and statistics.

    Built by :func:`moetray.engine.experts.load_offloaded_model`. Thread-safety: one forward
    at a time (the engine's batching loop); :meth:`snapshot` may be called from another
    thread and reads a consistent copy under the runtime's lock.
    """

    def __init__(self, store: ExpertStore, *, device: torch.device, capacity: int, top_k: int,
                 policy: str | None = None, qstar: Any = None, cpu_layers: frozenset[int] = frozenset(),
                 link_gbps: float | None = None, window_steps: int = 64,
                 allocate: Callable[..., torch.Tensor] | None = None, compute: str | None = None,
                 compile_decode: bool = False):
        self.compute = check_compute(compute)
        self._int8 = isinstance(store, Int8ExpertStore)
        if self._int8 and self.compute != "grouped_mm":
            raise UnknownComputeMode(f"int8 experts are computed by the grouped path only, "
                                     f"not {self.compute!r}")
        self.store = store
        self.device = torch.device(device)
        self.top_k = int(top_k)
        self.num_layers = store.num_layers
        self.num_experts = store.num_experts
        self.geometry = store.layers[0].geometry
        geo = self.geometry
        self._plain_swiglu = (geo.has_gate and geo.is_concatenated and not geo.has_bias
                              and not geo.is_transposed)
        self.policy = policy or DEFAULT_POLICY
        self.qstar = qstar
        self.cpu_layers = frozenset(cpu_layers)
        self.throttle = LinkThrottle(link_gbps) if link_gbps else None
        self._allocate = allocate
        self.cache = ExpertCache(self.num_layers, self.num_experts, capacity, policy=self.policy)
        self.pool = SlotPool(capacity, store.row_numel, store.slot_dtype, self.device,
                             throttle=self.throttle, allocate=allocate)
        self.slot_device = TorchSlotDevice(self.pool, store.row_bytes)
        self.slots = ExpertSlots(self.slot_device, store)
        self.resident = ResidentSlots(self.num_layers, self.num_experts)  # a compiled step's slot table
        self._slot_views = self._unpack_slots()
        self._slot_mats = self._gemm_operands()
        self._bank_mats: dict[tuple[int, int], Operands] = {}
        self._padded_out = padded_grouped_output(self.device)
        first = geo.segments[0].shape  # gate_up (or up) of one expert: [out, in], or [in, out] transposed
        self._proj_width = first[1] if geo.is_transposed else first[0]
        self._row0: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.RLock()
        self.window_steps = window_steps
        self._window: list[deque[tuple[int, int, int]]] = [deque(maxlen=window_steps)
                                                            for _ in range(self.num_layers)]
        self._window_tokens: deque[int] = deque(maxlen=window_steps)
        self.total_bytes = 0
        self.total_tokens = 0
        self.calls = 0
        self.share_threads = 1  # threads grouped calls share small groups over (the load sets the budget)
        self.shared_calls = 0  # grouped calls that offered helpers groups
        self.trace: list[tuple[int, tuple[int, ...]]] | None = None
        self.host_residency: list[str | None] = [None] * self.num_layers  # set by the loader
        self._fault: str | None = None
        self.fused: FusedExperts | None = None  # the compiled decode kernel, once warm_up built it
        self.decode_kernel_reason = self._fused_refusal(compile_decode)
        self.modules: list[Any] = []  # the Experts modules in MoE-layer order, set by attach()
        self.op_key = 0  # its name in a compiled step's graph (engine/experts/opaque.py), set by attach()

    def _fused_refusal(self, wanted: bool) -> str | None:
        if not wanted:
            return "off (--no-compile)"
        if self.compute != "grouped_mm":
            return f"the {self.compute} arithmetic was asked for"
        return fused_refusal(device=self.device, slot_dtype=self.store.slot_dtype, int8=self._int8,
                             host_share=self.qstar is not None or bool(self.cpu_layers))

    @property
    def decode_kernel(self) -> str:
        """``"compiled"`` when small batches run the compiled kernel, else ``"grouped"``."""
        return "compiled" if self.fused is not None else self.compute

    def warm_up(self) -> None:
        """Compile the decode kernel now, where it may serve (see :mod:`~moetray.engine.experts.fused`);
        a failed compilation is logged and leaves the grouped path (``decode_kernel_reason``)."""
        if self.decode_kernel_reason is not None or self.fused is not None or not self.modules:
            return
        with self._lock:
            layout = self.store.layout if isinstance(self.store, Int8ExpertStore) else None
            self.fused, self.decode_kernel_reason = compile_kernel(
                self.modules[0], self.geometry, layout, self.pool.rows,
                hidden=self.hidden_size, dtype=self.store.dtype, top_k=self.top_k)

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (the down projection's output features)."""
        geo = self.geometry
        down = next(seg for seg in geo.segments if seg.name == "down_proj").shape  # [out, in] or transposed
        return down[1] if geo.is_transposed else down[0]

    # --- geometry ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes one slot holds (one packed expert, decoded)."""
        return self.store.slot_bytes

    @property
    def backend(self) -> str:
        """``"hybrid"`` when q* sends a share of misses to the CPU, else ``"offload"``."""
        return "hybrid" if self.qstar is not None else "offload"

    @property
    def fetch_fraction(self) -> float | None:
        return None if self.qstar is None else getattr(self.qstar, "fraction", None)

    # --- the forward ---------------------------------------------------------------------

    def forward(self, module: ExpertsModule, layer: int, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Compute one MoE layer call with the arithmetic of the stock implementation named by
        :attr:`compute`; see the module docstring for the steps."""
        if self.kernel_serves(top_k_index):
            return self._forward_fused(module, layer, hidden_states, top_k_index, top_k_weights)
        if self.compute == "grouped_mm":
            return self._forward_grouped(module, layer, hidden_states, top_k_index, top_k_weights)
        return self._forward_eager(module, layer, hidden_states, top_k_index, top_k_weights)

    def kernel_serves(self, top_k_index: torch.Tensor) -> bool:
        """Whether the compiled decode kernel computes this call: built, in place of the grouped
        path, a decode-size batch, no autograd (eagerly and traced in a compiled step alike)."""
        return (self.fused is not None and self.compute == "grouped_mm"
                and top_k_index.shape[0] <= FUSED_MAX_TOKENS and not torch.is_grad_enabled())

    def _forward_grouped(self, module: ExpertsModule, layer: int, hidden_states: torch.Tensor,
                         top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The stock ``grouped_mm`` implementation's arithmetic over the slot pool.

        Token-expert pairs are ordered by the same ``torch.sort`` the stock path uses; each
        routed expert's rows are one group, multiplied with ``mm`` into a grouped output laid
        out as the stock kernel lays it out: exactly the per-group ``mm_out`` calls of
        PyTorch's grouped-mm CPU kernel, minus the empty groups of experts nobody routed to
        (the stock kernel visits every expert). Gate, routing weights, un-permutation and the
        sum over top-k are whole-batch ops on tensors of the stock shapes. So in fp32 on the
        CPU the output is bit-identical to ``grouped_mm`` with every expert resident.
        """
        num_tokens, num_top_k = top_k_index.shape
        pairs = num_tokens * num_top_k
        hidden_dim = hidden_states.shape[-1]
        num_experts = self.num_experts
        expert_ids = top_k_index.reshape(-1)
        sorted_ids, perm = torch.sort(expert_ids)
        ids = sorted_ids.tolist()  # the call's one host read of the routing
        groups: list[tuple[int, int, int]] = []  # (expert, first row, end row), ascending expert ids
        start = 0
        while start < pairs:
            expert = ids[start]
            if expert >= num_experts:
                break  # expert-parallel sentinels sort last and contribute nothing
            end = bisect_right(ids, expert, start)
            groups.append((expert, start, end))
            start = end
        valid = start
        routed = [expert for expert, _, _ in groups]
        states = hidden_states.index_select(0, perm // num_top_k)
        weights = top_k_weights.reshape(-1).index_select(0, perm)

        with self._lock:  # held for the whole call: a resize never swaps rows mid-compute
            plan = self._plan(layer, routed)
            host_groups = ([i for i, slot in enumerate(plan.slots) if slot is None]
                           if self.device.type != "cpu" and None in plan.slots else [])
            # Bring the CPU share's inputs to the host before the slot copies are queued, so
            # the device→host transfer does not wait behind them and the CPU work overlaps them.
            host_states = states.cpu() if host_groups else None
            self._fill(layer, plan, num_tokens)

            slot_mats, bank_mats = self._slot_mats, self._bank_operands
            group_ops = [slot_mats[slot] if slot is not None else bank_mats(layer, expert)
                         for (expert, _, _), slot in zip(groups, plan.slots, strict=True)]
            on_device = list(zip(groups, group_ops, strict=True))
            if host_groups:
                on_device = [item for i, item in enumerate(on_device) if i not in host_groups]
            proj = grouped_output(pairs, self._proj_width, states, self._padded_out)
            shared = project(proj, states, [(lo, hi, w, b) for (_, lo, hi), (w, b, _, _) in on_device],
                             share_threads=self.share_threads)
            if valid < pairs:
                proj[valid:].zero_()
            proj = module._apply_gate(proj) if self.geometry.has_gate else module.act_fn(proj)
            out = grouped_output(pairs, hidden_dim, states, self._padded_out)
            shared |= project(out, proj, [(lo, hi, w, b) for (_, lo, hi), (_, _, w, b) in on_device],
                              share_threads=self.share_threads)
            self.shared_calls += shared
            if host_states is not None:  # the CPU share, when there is one
                for i in host_groups:
                    _, lo, hi = groups[i]
                    out[lo:hi].copy_(self._host_expert(module, group_ops[i], host_states[lo:hi]))
            if valid < pairs:
                out[valid:].zero_()
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        weighted = out * weights.unsqueeze(-1)
        restored = weighted.index_select(0, torch.argsort(perm))
        return restored.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def _forward_fused(self, module: ExpertsModule, layer: int, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """A small batch through the compiled kernel: plan and copy as the grouped path does, then
        one kernel call over every token-expert pair's slot (every routed expert has one here:
        the kernel serves no host share)."""
        with self._lock:  # held for the whole call: a resize never swaps rows mid-compute
            slots = self.fused_slots(layer, top_k_index)
            if slots is None:  # expert-parallel sentinels: the grouped path skips them
                return self._forward_grouped(module, layer, hidden_states, top_k_index, top_k_weights)
            kernel = self.fused
            assert kernel is not None, "forward() takes this path only with a kernel"
            return kernel(module, hidden_states, slots, top_k_weights)

    def fused_slots(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """``[T, k]`` routed experts → ``[T, k]`` the slots the decode kernel reads them from: plan,
        copy the misses in and count the call, as the grouped path does (one host read of the
        routing); None for expert-parallel sentinels (ids past the experts), which it does not serve.

        The kernel's caller computes next: in a compiled step that is the step's own graph
        (:meth:`planned_slots`), after this returns and before the next layer plans; pools are
        resized only between steps (the paused loop)."""
        pairs = top_k_index.tolist()
        routed = sorted({expert for row in pairs for expert in row})
        if routed and routed[-1] >= self.num_experts:
            return None
        with self._lock:
            plan = self._plan(layer, routed)
            self._fill(layer, plan, len(pairs))
        slot_of = dict(zip(routed, plan.slots, strict=True))
        return torch.tensor([[slot_of[e] for e in row] for row in pairs], dtype=torch.long)

    def planned_slots(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """A compiled step's ``moetray::expert_slots`` for a call that misses: the served calls before
        it settled first, then planned as :meth:`fused_slots` plans it (None: expert-parallel sentinels)."""
        with self._lock:
            for call in self.resident.take(self.op_key):
                self._settle_hit(*call)
            slots = self.fused_slots(layer, top_k_index)
            if slots is not None:
                assert self.fused is not None, "a compiled step plans here only where the kernel serves"
                self.fused.calls += 1
            return slots

    def settle_step(self) -> None:
        """A compiled step returned: the planner sees the calls the slot table served (``resident.py``)."""
        with self._lock:
            for call in self.resident.take(self.op_key):
                self._settle_hit(*call)

    def _settle_hit(self, layer: int, routed: list[int], tokens: int) -> None:
        """Count a call the slot table served as the pure hit it is (``ExpertCache.record_hits``: no
        plan to build, validate or apply); a routed expert without a slot means the table lied."""
        if self.trace is not None:
            self.trace.append((layer, tuple(routed)))
        try:
            hits = self.cache.record_hits(layer, routed)
        except CacheRefused as exc:
            if exc.kind != "not_resident":
                raise
            raise CacheIntegrityError(f"the slot table served experts with no slot: {exc}") from exc
        self._record(layer, hits, 0, 0, tokens)
        assert self.fused is not None, "the slot table serves only where the kernel does"
        self.fused.calls += 1

    def _host_expert(self, module: ExpertsModule, ops: Operands, states: torch.Tensor) -> torch.Tensor:
        """One expert of the CPU share on a CUDA device: computed by the CPU from the host store."""
        w, bias, w_down, bias_down = ops
        proj = int8_gemm(states, w) if type(w) is Int8Weight else states @ w
        if bias is not None:
            proj = proj + bias
        proj = module._apply_gate(proj) if self.geometry.has_gate else module.act_fn(proj)
        out = int8_gemm(proj, w_down) if type(w_down) is Int8Weight else proj @ w_down
        return out + bias_down if bias_down is not None else out

    def _fill(self, layer: int, plan, tokens: int) -> None:
        """Copy the plan's misses into their slots and count the call (the lock held)."""
        moved = self.pool.bytes_copied
        for evicted in plan.evicted:
            self.resident.drop(*evicted)
        try:
            self.slots.apply(plan)
        except SlotDeviceError as exc:
            self._forget_plan(plan, exc)
            raise
        for slot, expert in plan.copies:
            self.resident.admit(layer, expert, slot)
        self._record(layer, plan.hits, plan.misses, self.pool.bytes_copied - moved, tokens)

    def _forget_plan(self, plan, exc: SlotDeviceError) -> None:
        # The written slots are unknown, the failing one too, and the plan's later copies never
        # happened: the planner must forget every slot this plan filled.
        for slot in {*exc.unknown_slots, *(s for s, _ in plan.copies)}:
            lost = self.cache.forget_slot(slot)
            if lost is not None:
                self.resident.drop(*lost)
            self.slots.forget(slot)

    def _bank_operands(self, layer: int, expert: int) -> Operands:
        """``(layer, expert)``'s GEMM operands straight from the host store (cached views)."""
        ops = self._bank_mats.get((layer, expert))
        if ops is None:
            store = self.store
            ops = (store.operands(store.row(layer, expert)) if isinstance(store, Int8ExpertStore)
                   else operands(store.weights(layer, expert), self.geometry))
            if not self.store.quantized:  # a quantized store decodes per call and keeps no copy
                self._bank_mats[(layer, expert)] = ops
        return ops

    def _gemm_operands(self) -> list[Operands]:
        """Per slot, the grouped path's GEMM operands: views of the pool's rows (rebuilt with them)."""
        if isinstance(self.store, Int8ExpertStore):
            return [self.store.operands(self.pool.rows[slot]) for slot in range(self.pool.capacity)]
        return [operands(views, self.geometry) for views in self._slot_views]

    def _forward_eager(self, module: ExpertsModule, layer: int, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The stock ``eager`` loop's arithmetic: one expert at a time, ascending ids, ``index_add_``."""
        num_experts = self.num_experts
        final_hidden_states = torch.zeros_like(hidden_states)
        single: dict[int, int] | None = None  # one token (decode): expert → its top-k position
        if hidden_states.shape[0] == 1:
            row = top_k_index[0].tolist()
            if len(set(row)) == len(row):
                single = {e: pos for pos, e in enumerate(row) if e < num_experts}
        if single is not None:
            # The eager loop's masks select, for one token, exactly row 0 and this position;
            # plain slices pick the same values without building the masks.
            expert_mask = None
            routed = sorted(single)
        else:
            with torch.no_grad():
                expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
                expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            routed = [e for e in expert_hit[:, 0].tolist() if e < num_experts]

        with self._lock:  # held for the whole call: a resize never swaps rows mid-compute
            plan = self._plan(layer, routed)
            on_cpu = ([e for e, slot in zip(routed, plan.slots, strict=True) if slot is None]
                      if self.device.type != "cpu" and None in plan.slots else [])
            if on_cpu:
                # Bring this call's inputs to the host before the slot copies are queued, so the
                # device→host transfer does not wait behind them and the CPU work overlaps them.
                host = (hidden_states.cpu(), top_k_weights.cpu(),
                        None if expert_mask is None else expert_mask.cpu())
            else:
                host = None
            self._fill(layer, plan, hidden_states.shape[0])

            computed: dict[int, torch.Tensor] = {}
            geo, plain = self.geometry, self._plain_swiglu
            if host is not None:
                for expert in on_cpu:
                    _, states, weights = select_rows(expert, single, *host)
                    computed[expert] = eager_expert(module, geo, plain, self.store.weights(layer, expert),
                                                    states, weights)
            for expert, slot in zip(routed, plan.slots, strict=True):
                token_idx, states, weights = select_rows(expert, single, hidden_states, top_k_weights,
                                                         expert_mask)
                if expert in computed:
                    current = computed[expert].to(hidden_states.device)
                else:
                    w = self.store.weights(layer, expert) if slot is None else self._slot_views[slot]
                    current = eager_expert(module, geo, plain, w, states, weights)
                if token_idx is None:
                    token_idx = self._first_row(hidden_states.device)
                final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states

    def _first_row(self, device: torch.device) -> torch.Tensor:
        index = self._row0.get(device)
        if index is None:
            index = self._row0[device] = torch.zeros(1, dtype=torch.long, device=device)
        return index

    def _unpack_slots(self) -> list[dict[str, torch.Tensor]]:
        """Per-slot views of the pool's rows as the module's tensors (rebuilt when rows change); none
        for int8 rows, which only the grouped path reads (through :meth:`_gemm_operands`)."""
        if self._int8:
            return []
        return [unpack_row(self.pool.rows[slot], self.geometry) for slot in range(self.pool.capacity)]

    def _plan(self, layer: int, routed: list[int]):
        fetch_limit: int | Callable[[int], int] | None = None
        if layer in self.cpu_layers:
            fetch_limit = 0  # a CPU layer: every miss is computed from host memory
        elif self.qstar is not None:
            fetch_limit = self.qstar.fetch_count  # q*: fetch this share of the call's misses
        if self.trace is not None:
            self.trace.append((layer, tuple(routed)))
        return self.cache.ensure(layer, routed, fetch_limit=fetch_limit)

    def _record(self, layer: int, hits: int, misses: int, nbytes: int, tokens: int) -> None:
        self._window[layer].append((hits, misses, nbytes))
        self.total_bytes += nbytes
        self.calls += 1
        if layer == 0:
            self._window_tokens.append(tokens)
            self.total_tokens += tokens

    # --- telemetry -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The telemetry ``experts`` object: the keys of ``policy.wire.ExpertStats``.

        Mutates nothing. Window figures cover each layer's last ``window_steps`` calls;
        ``hit_rate`` and ``bytes_per_token`` are None before any routing.
        """
        with self._lock:
            per_layer = self.cache.per_layer_stats()
            window_hits = [sum(h for h, _, _ in w) for w in self._window]
            window_misses = [sum(m for _, m, _ in w) for w in self._window]
            window_bytes = [sum(b for _, _, b in w) for w in self._window]
            routed = sum(window_hits) + sum(window_misses)
            tokens = sum(self._window_tokens)
            return {
                "residency": self.cache.residency_map(),
                "recency": self.cache.recency_map(),
                "window_hits": window_hits,
                "window_misses": window_misses,
                "window_bytes": window_bytes,
                "total_hits": sum(s.hits for s in per_layer),
                "total_misses": sum(s.misses for s in per_layer),
                "total_bytes": self.total_bytes,
                "hit_rate": sum(window_hits) / routed if routed else None,
                "bytes_per_token": sum(window_bytes) / tokens if tokens else None,
                "backend": self.backend,
                "fetch_fraction": self.fetch_fraction,
                "expert_store_bytes": self.store.total_bytes,
                "expert_store_format": self.store.format,
            }

    def reset_window(self) -> None:
        """Empty the sliding window (totals, residency and recency are kept)."""
        with self._lock:
            for w in self._window:
                w.clear()
            self._window_tokens.clear()

    def start_trace(self) -> None:
        """Record ``(layer, routed expert ids)`` for every call from now on."""
        self.trace = []

    def stop_trace(self) -> list[tuple[int, tuple[int, ...]]]:
        trace, self.trace = self.trace or [], None
        return trace

    # --- resize and integrity ------------------------------------------------------------

    def inject_resize_fault(self, stage: str | None) -> None:
        """Make the next :meth:`resize` fail at ``stage`` (``"before_teardown"``: the allocation
        fails; ``"after_teardown"``: it fails right after ``mark_teardown``); None clears it."""
        if stage not in (None, "before_teardown", "after_teardown"):
            raise ValueError(f"unknown fault stage {stage!r}")
        self._fault = stage

    def resize(self, capacity: int, mark_teardown: Callable[[], None] | None = None) -> dict[str, Any]:
        """Change the slot pool to ``capacity`` slots, keeping the hottest experts resident.

        Order: validate; allocate the new pool (an allocation failure raises
        :class:`ResizeFault` ``allocation_failed`` before anything changed); call
        ``mark_teardown()``; let the planner decide what stays (``ExpertCache.resize``); move
        the survivors and swap pools (``ExpertSlots.apply_resize``). The old pool is freed
        only after the swap. Returns ``{"old_capacity", "capacity", "kept", "dropped",
        "moved"}``. Refuses ``below_floor`` (from the planner) before any change; the same
        capacity is a no-op that does not call ``mark_teardown``.
        """
        with self._lock:
            old = self.cache.capacity
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise CacheRefused("below_floor", f"capacity {capacity} < 1 slot", capacity=capacity, floor=1)
            if capacity == old:
                return self.keep_capacity()
            fault, self._fault = self._fault, None
            try:
                if fault == "before_teardown":
                    raise RuntimeError("injected allocation failure")
                self.slot_device.reserve(capacity)
            except Exception as exc:
                raise ResizeFault("allocation_failed", f"allocating {capacity} slots failed: {exc}",
                                  torn_down=False) from exc
            try:
                if mark_teardown is not None:
                    mark_teardown()
                if fault == "after_teardown":
                    raise ResizeFault("injected_after_teardown",
                                      "injected failure after teardown; the old pool was kept",
                                      torn_down=True)
            except BaseException:
                self.slot_device.release_reserved()
                raise
            plan = self.cache.resize(capacity)
            try:
                self.slots.apply_resize(plan)
            except SlotDeviceError as exc:
                for slot in exc.unknown_slots:
                    self.cache.forget_slot(slot)
                    self.slots.forget(slot)
                raise
            finally:
                self.resident.rebuild(self.cache.residency_map())
                self._slot_views = self._unpack_slots()
                self._slot_mats = self._gemm_operands()
                if self.fused is not None:
                    self.fused.bind(self.pool.rows)
            return {"old_capacity": old, "capacity": capacity, "kept": self.cache.resident_count,
                    "dropped": len(plan.dropped), "moved": len(plan.moves)}

    def keep_capacity(self) -> dict[str, Any]:
        """The deliberate no-op of :meth:`resize` at the current size."""
        return {"old_capacity": self.capacity, "capacity": self.capacity,
                "kept": self.cache.resident_count, "dropped": 0, "moved": 0}

    def check_integrity(self, deep: bool = False) -> None:
        """Raise when the planner and the slot pool disagree.

        Checks the planner's own invariants, that the executor's record of each slot's bytes
        matches the planner's occupant for every occupied slot, that no slot is unknown and
        that the pool has ``capacity`` rows. ``deep`` also compares each occupied slot's bytes
        with the host store's row. Mutates nothing.
        """
        with self._lock:
            self.cache.check_integrity()
            if self.pool.capacity != self.cache.capacity or self.slots.slot_count != self.cache.capacity:
                raise CacheIntegrityError(f"planner has {self.cache.capacity} slots, pool "
                                          f"{self.pool.capacity}, executor {self.slots.slot_count}")
            bad = self.slots.disagreements(self.cache.occupant)
            if bad:
                raise CacheIntegrityError(f"slots {bad[:8]} hold other bytes than the planner thinks "
                                          f"({len(bad)} in all)")
            unknown = self.slots.unknown_slots()
            if unknown:
                raise CacheIntegrityError(f"slots {unknown[:8]} hold unknown bytes")
            stale = self.resident.disagreements(self.cache.residency_map())
            if stale:
                raise CacheIntegrityError(f"the slot table disagrees with the planner on (layer, expert) "
                                          f"{stale[:8]} ({len(stale)} in all)")
            if deep:
                for slot in range(self.cache.capacity):
                    owner = self.cache.occupant(slot)
                    if owner is not None and not torch.equal(
                            self.pool.rows[slot].cpu(), self.store.decoded_row(*owner).cpu()):
                        raise CacheIntegrityError(f"slot {slot} bytes differ from expert {owner}'s row")


# --- the registered experts implementation ----------------------------------------------------


def moetray_experts_forward(self: ExpertsModule, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface entry point: ``[T, H], [T, k], [T, k] → [T, H]``."""
    runtime: ExpertRuntime | None = getattr(self, _RUNTIME_ATTR, None)
    if runtime is None:
        raise RuntimeError(f"{type(self).__name__} is not attached to a moetray ExpertRuntime; "
                           "load the model with moetray.engine.experts.load_offloaded_model")
    layer = getattr(self, _LAYER_ATTR)
    if torch.compiler.is_compiling():  # a compiled decode step: plan opaquely, compute in the graph
        if runtime.kernel_serves(top_k_index):
            slots = runtime.resident.traced(top_k_index, runtime.op_key, layer)
            assert runtime.fused is not None
            return runtime.fused.traced(self, hidden_states, slots, top_k_weights)
        return experts_op(hidden_states, top_k_index, top_k_weights, runtime.op_key, layer)
    return runtime.forward(self, layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register :func:`moetray_experts_forward` as ``"moetray"`` (idempotent)."""
    register_experts_function(IMPLEMENTATION_NAME, moetray_experts_forward)


def attach(modules: list[torch.nn.Module], runtime: ExpertRuntime) -> None:
    """Point each Experts module (in MoE-layer order) at ``runtime``."""
    for layer, module in enumerate(modules):
        setattr(module, _RUNTIME_ATTR, runtime)
        setattr(module, _LAYER_ATTR, layer)
    runtime.modules = list(modules)
    runtime.op_key = register_op_key(runtime)


def runtimes_in(module: torch.nn.Module) -> list[ExpertRuntime]:
    """The runtimes :func:`attach` pointed ``module``'s Experts modules at, each once."""
    found = {id(r): r for m in module.modules() if (r := getattr(m, _RUNTIME_ATTR, None)) is not None}
    return list(found.values())
