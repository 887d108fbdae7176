"""MoEfication of one dense SwiGLU FFN: a shared expert plus routed experts and a linear router.

The split is an exact partition of the FFN's neurons (gate and up rows, down columns), so with
every expert active the layer computes the dense FFN. What the calibration decides:

1. **Shared expert**: the ``shared_size`` neurons with the largest mean contribution
   ``|h_i| · ‖W_down[:, i]‖`` are always on (none in the Mixtral layout).
2. **Groups**: the other neurons are grouped by co-activation. A neuron's feature is its
   contribution over calibration tokens, normalised per token and then per neuron; balanced
   spherical k-means puts equally many neurons in each group.
3. **Router**: ridge regression, without intercept (the routers have no bias), from the FFN
   input to each group's output norm ``‖W_down[:, g] h_g‖``; top-k of its scores picks groups.
   Its scale is set afterwards (see :func:`scale_router`), which does not change the ranking.

All statistics are taken in float64 and every tie is broken by index, so the decisions do not
depend on the thread count that produced the float32 activations, only on their values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerSplit:
    """One layer's MoEfication: neuron ids per expert and the router that picks them."""

    shared: torch.Tensor  # [S] int64 neuron ids of the always-on shared expert (S may be 0), sorted
    experts: torch.Tensor  # [E, m] int64 neuron ids per routed expert, each row sorted
    router: torch.Tensor  # [E, H] float64 ridge scores (unscaled)

    @property
    def num_experts(self) -> int:
        return int(self.experts.shape[0])


def swiglu_hidden(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The FFN's neuron activations ``silu(x W_gᵀ) ⊙ (x W_uᵀ)`` for tokens ``x`` [N, H] → [N, I]."""
    return F.silu(x @ w_gate.T) * (x @ w_up.T)


def neuron_contributions(h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """How much each neuron writes into the output per token: ``|h_i| · ‖W_down[:, i]‖`` (float64)."""
    return h.double().abs() * w_down.double().norm(dim=0)


def pick_shared(contrib: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` neurons with the largest mean contribution, sorted by id (ties: lower id first)."""
    if size == 0:
        return torch.empty(0, dtype=torch.long)
    order = torch.sort(-contrib.mean(dim=0), stable=True).indices
    return torch.sort(order[:size]).values


def coactivation_features(contrib: torch.Tensor) -> torch.Tensor:
    """Neuron × token features: contributions normalised per token, then per neuron (unit rows)."""
    per_token = contrib / contrib.sum(dim=1, keepdim=True).clamp_min(1e-30)
    feats = per_token.T.contiguous()
    return feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-30)


def balanced_assign(sim: torch.Tensor, capacity: int) -> torch.Tensor:
    """Assign each row to a column, at most ``capacity`` rows per column, greedily by similarity.

    Pairs are taken in descending similarity (ties in flat index order). Needs
    ``rows <= capacity * columns``; returns int64 labels [rows].
    """
    rows, cols = sim.shape
    if rows > capacity * cols:
        raise ValueError(f"{rows} rows do not fit {cols} columns of {capacity}")
    order = torch.sort(-sim.flatten(), stable=True).indices.tolist()
    labels = [-1] * rows
    fill = [0] * cols
    left = rows
    for flat in order:
        r, c = divmod(flat, cols)
        if labels[r] < 0 and fill[c] < capacity:
            labels[r] = c
            fill[c] += 1
            left -= 1
            if left == 0:
                break
    return torch.tensor(labels, dtype=torch.long)


def balanced_spherical_kmeans(feats: torch.Tensor, num_clusters: int, iters: int,
                              generator: torch.Generator) -> torch.Tensor:
    """Cluster unit rows into ``num_clusters`` equal groups; returns labels [n] (int64).

    Starts from a seeded random equal split; stops early when the labels stop changing.
    """
    n = feats.shape[0]
    if n % num_clusters:
        raise ValueError(f"{n} neurons do not split into {num_clusters} equal groups")
    cap = n // num_clusters
    labels = torch.empty(n, dtype=torch.long)
    labels[torch.randperm(n, generator=generator)] = torch.arange(n) // cap
    for _ in range(iters):
        centroids = torch.zeros(num_clusters, feats.shape[1], dtype=feats.dtype).index_add_(0, labels, feats)
        centroids = centroids / centroids.norm(dim=1, keepdim=True).clamp_min(1e-30)
        new = balanced_assign(feats @ centroids.T, cap)
        if torch.equal(new, labels):
            break
        labels = new
    return labels


def group_output_norms(h: torch.Tensor, w_down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``‖W_down[:, g] h_g‖`` per token and group → [N, E] float64."""
    out = torch.empty(h.shape[0], groups.shape[0], dtype=torch.float64)
    for e, idx in enumerate(groups):
        out[:, e] = (h[:, idx].double() @ w_down[:, idx].double().T).norm(dim=1)
    return out


def ridge_router(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """Closed-form ridge ``W = (XᵀX + λI)⁻¹ XᵀY`` without intercept, ``λ = α·tr(XᵀX)/H``; → [E, H]."""
    xd = x.double()
    gram = xd.T @ xd
    lam = alpha * torch.trace(gram) / gram.shape[0]
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    return torch.linalg.solve(gram + lam * eye, xd.T @ y.double()).T.contiguous()


def scale_router(router: torch.Tensor, x: torch.Tensor, logit_spread: float) -> torch.Tensor:
    """The router rescaled so no token of ``x`` has logits spread wider than ``logit_spread`` (float64).

    Tiny logits make the softmax uniform, so each expert's routing weight is ≈ 1/E (Qwen2-MoE)
    or ≈ 1/k after top-k renormalisation (Mixtral); the down projections carry the inverse
    factor. Bounding the widest per-token spread (max − min logit), not the average, bounds
    every token's weight error by about ``logit_spread`` relative, including the position-0
    tokens whose hidden states are outliers. The ranking, hence the routing, is unchanged.
    """
    logits = x.double() @ router.T
    widest = float((logits.max(dim=1).values - logits.min(dim=1).values).max())
    return router * (logit_spread / widest)


def fit_layer(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
              shared_size: int, num_experts: int, grouping_tokens: int, kmeans_iters: int,
              ridge_alpha: float, generator: torch.Generator) -> LayerSplit:
    """MoEfy one FFN from its inputs ``x`` [N, H] on calibration text; mutates nothing.

    Refuses with ``ValueError`` when the routed neurons do not split into equal groups.
    """
    inter = w_gate.shape[0]
    routed = inter - shared_size
    if routed <= 0 or routed % num_experts:
        raise ValueError(f"{routed} routed neurons do not split into {num_experts} experts")
    h = swiglu_hidden(x, w_gate, w_up)
    contrib = neuron_contributions(h, w_down)
    shared = pick_shared(contrib, shared_size)
    keep = torch.ones(inter, dtype=torch.bool)
    keep[shared] = False
    routed_ids = torch.nonzero(keep).flatten()
    stride = max(1, x.shape[0] // grouping_tokens)
    feats = coactivation_features(contrib[::stride, routed_ids][:grouping_tokens])
    labels = balanced_spherical_kmeans(feats, num_experts, kmeans_iters, generator)
    experts = torch.stack([torch.sort(routed_ids[labels == e]).values for e in range(num_experts)])
    targets = group_output_norms(h, w_down, experts)
    return LayerSplit(shared, experts, ridge_router(x, targets, ridge_alpha))


def moe_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            split: LayerSplit, top_k: int) -> torch.Tensor:
    """The MoEfied layer's output on ``x`` at ``top_k`` with unit routing weights (float32)."""
    h = swiglu_hidden(x, w_gate, w_up)
    chosen = torch.topk(x.double() @ split.router.T, top_k, dim=1, sorted=False).indices
    mask = torch.zeros_like(h, dtype=torch.bool)
    rows = torch.arange(x.shape[0]).unsqueeze(1)
    for j in range(top_k):
        mask[rows, split.experts[chosen[:, j]]] = True
    mask[:, split.shared] = True
    return (h * mask) @ w_down.T
