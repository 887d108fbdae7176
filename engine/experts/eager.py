"""The stock ``eager`` experts loop's arithmetic, per expert, for the runtime's ``"eager"`` mode.

Bit-identical in float32 to transformers' eager implementation: the same ops in the same order on
the same tensors; only where an expert's weights are read from (a slot, or the host store) differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetray.engine.experts.hf import DEFAULT_APPLY_GATE, ExpertsModule
from moetray.engine.experts.store import ExpertGeometry

__all__ = ["eager_expert", "select_rows"]


def eager_expert(module: ExpertsModule, geo: ExpertGeometry, plain_swiglu: bool, w: dict[str, torch.Tensor],
                 current_state: torch.Tensor, routing_weight: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens, in the stock eager implementation's op order (``plain_swiglu``: the
    geometry of the common case, concatenated gate and up without bias, run verbatim)."""
    if plain_swiglu and type(module)._apply_gate is DEFAULT_APPLY_GATE:
        # The stock eager loop, verbatim (the common case: Qwen, Mixtral, OLMoE, …).
        gate, up = F.linear(current_state, w["gate_up_proj"]).chunk(2, dim=-1)
        return F.linear(module.act_fn(gate) * up, w["down_proj"]) * routing_weight
    if geo.has_gate:
        proj = _linear(current_state, w["gate_up_proj"], w.get("gate_up_proj_bias"), geo.is_transposed)
        hidden = module._apply_gate(proj)  # the default: chunk(2) → act(gate) * up, as eager
    else:
        hidden = module.act_fn(_linear(current_state, w["up_proj"], w.get("up_proj_bias"),
                                       geo.is_transposed))
    hidden = _linear(hidden, w["down_proj"], w.get("down_proj_bias"), geo.is_transposed)
    if getattr(module, "has_post_expert_norm", False):
        hidden = module.post_expert_norm(hidden)
    return hidden * routing_weight


def select_rows(expert: int, single: dict[int, int] | None, states: torch.Tensor, weights: torch.Tensor,
                mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(token_idx, the expert's input rows, its routing weights)`` as the eager loop gathers
    them; for a single token, ``token_idx`` is None (row 0) and slices replace the gathers."""
    if single is not None:
        pos = single[expert]
        return None, states, weights[:, pos:pos + 1]
    assert mask is not None, "the masks exist whenever the single-token slices do not"
    top_k_pos, token_idx = torch.where(mask[expert])
    return token_idx, states[token_idx], weights[token_idx, top_k_pos, None]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    if transposed:
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)
