"""Count which experts MoE routers pick, with forward hooks on the router modules.

Hooks see the chosen indices, which are the truth even for routers that pick by biased sigmoid
scores (GLM-4.5) and for models that never return router logits. Each router is counted once
per micro-batch (gradient checkpointing re-runs forwards during backward) and padding is excluded.
"""

from __future__ import annotations

import math

import torch


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Router modules of transformers 5 MoE models: ``mlp.gate`` style modules whose class ends in Router."""
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith(("Router", "TopkRouter", "TopKRouter")):
            routers.append((name, module))
    return routers


def num_experts_of(router: torch.nn.Module) -> int:
    for attr in ("num_experts", "n_routed_experts"):
        if isinstance(getattr(router, attr, None), int):
            return getattr(router, attr)
    return int(router.weight.shape[0])


class ExpertCounter:
    """Accumulates per-layer selection counts between flushes."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.num_experts = num_experts_of(self.routers[0][1]) if self.routers else 0
        self.top_k = int(getattr(self.routers[0][1], "top_k", 0)) if self.routers else 0
        self.counts = [torch.zeros(self.num_experts, dtype=torch.long) for _ in self.routers]
        self.token_mask: torch.Tensor | None = None
        self._seen: set[int] = set()
        self._handles = [
            module.register_forward_hook(self._hook(i)) for i, (_, module) in enumerate(self.routers)
        ]

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def start_micro_batch(self, token_mask: torch.Tensor | None) -> None:
        """Call before each forward: which tokens are real, and reset the counted-once set."""
        self.token_mask = token_mask.reshape(-1) if token_mask is not None else None
        self._seen.clear()

    def stop(self) -> None:
        """No counting (evaluation, generation)."""
        self._seen = set(range(len(self.routers)))

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if index in self._seen:
                return
            self._seen.add(index)
            indices = output[-1] if isinstance(output, tuple) else None
            if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int64, torch.int32):
                return
            indices = indices.detach().reshape(-1, indices.shape[-1])
            if self.token_mask is not None and self.token_mask.numel() == indices.shape[0]:
                indices = indices[self.token_mask.to(indices.device)]
            self.counts[index] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts)[
                : self.num_experts
            ]

        return hook

    def flush(self, all_reduce=None) -> list[dict]:
        """Per-layer statistics since the last flush; ``all_reduce`` sums counts across ranks."""
        layers = []
        for i, (name, _) in enumerate(self.routers):
            counts = self.counts[i]
            if all_reduce is not None:
                counts = all_reduce(counts)
            counts_list = [int(c) for c in counts.tolist()]
            total = sum(counts_list)
            fractions = [c / total if total else 0.0 for c in counts_list]
            mean = total / len(counts_list) if counts_list else 0
            layers.append(
                {
                    "layer": i,
                    "name": name,
                    "counts": counts_list,
                    "fractions": [round(f, 6) for f in fractions],
                    "tokens": total // self.top_k if self.top_k else total,
                    "imbalance": round(max(counts_list) / mean, 4) if mean else None,
                    "entropy": round(-sum(f * math.log(f) for f in fractions if f > 0), 6),
                }
            )
            self.counts[i].zero_()
        return layers

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
