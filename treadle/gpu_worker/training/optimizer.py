"""One `torch.optim.AdamW` per session, over that session's adapter parameters only.

The hyperparameters come with every `optim_step` (Tinker's `AdamParams`), so they are written into
the param group right before the step; the moments persist between steps. Gradients accumulate
across `forward_backward` calls and are applied and cleared here.

State travels by portable parameter name (`<param>.exp_avg`, `<param>.exp_avg_sq`, `<param>.step`),
never by position, so a checkpoint restores exactly onto the right tensors or fails loudly.

A full session on a sharded group trains DTensors (each rank's shards, treadle.gpu_worker.model.full_weights): its
AdamW steps each rank's shards, clipping sees the global norm (torch's norm of DTensor gradients is a collective),
and its state travels whole (gathered to write, cut into this rank's shards to read).
"""

from __future__ import annotations

import torch
from torch import nn

from treadle.errors import InvalidRequestError
from treadle.gpu_worker.model.sharding import placed_like, whole
from treadle.types import AdamParams

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "step")


# Devices with torch's fused AdamW kernel: one pass per tensor, where the default implementation runs a dozen
# elementwise ops per parameter (CPU) or per group of parameters (CUDA). Measured on one CPU thread: 0.59 -> 0.10
# ms a step for the tiny model's adapter, 25.7 -> 8.2 ms for a SmolLM2-sized one (r32 on every linear). It
# rounds differently from the default by about an ulp; a session's steps stay bitwise reproducible.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


class SessionOptimizer:
    def __init__(self, params: dict[str, nn.Parameter]):
        self.params = params
        defaults = AdamParams()
        self.adamw = torch.optim.AdamW(
            list(params.values()),
            lr=defaults.learning_rate,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
            fused=all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params.values()),
        )
        self.size = sum(p.numel() for p in params.values())  # trainable parameters

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def step(self, hp: AdamParams) -> dict[str, float]:
        """Clip (if asked), apply one AdamW step with `hp`, clear the gradients. Returns metrics."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if hp.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(list(self.params.values()), hp.grad_clip_norm, total_norm)
        for group in self.adamw.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        self.adamw.step()
        self.zero_grad()
        grad_norm = total_norm.item() if total_norm is not None else 0.0
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": hp.learning_rate}

    # ------------------------------------------------------------ state by name

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Adam moments and per-parameter step counts, keyed `<param>.<moment>` (CPU copies)."""
        out = {}
        for name, param in self.params.items():
            for key, value in self.adamw.state.get(param, {}).items():
                out[f"{name}.{key}"] = whole(value.detach()).cpu().clone().reshape(value.shape)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Restore moments exactly. Either every parameter has its three entries, or none (never stepped)."""
        expected = {f"{name}.{key}" for name in self.params for key in _MOMENT_KEYS}
        if not tensors:
            self.adamw.state.clear()
            return
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or unexpected:
            raise InvalidRequestError(
                f"{source}: optimizer state does not match the adapter (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        state_dict = self.adamw.state_dict()
        state_dict["state"] = {}
        for index, (name, param) in enumerate(self.params.items()):
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(tensors[f"{name}.{key}"].shape) != tuple(param.shape):
                    raise InvalidRequestError(
                        f"{source}: {name}.{key} has shape {tuple(tensors[f'{name}.{key}'].shape)}, expected {tuple(param.shape)}"
                    )
            moments = {key: tensors[f"{name}.{key}"].clone() for key in _MOMENT_KEYS}
            state_dict["state"][index] = {key: placed_like(t, param) if t.dim() else t for key, t in moments.items()}
        self.adamw.load_state_dict(state_dict)

    def grad_tensors(self) -> dict[str, torch.Tensor]:
        """Accumulated gradients not yet applied, by parameter name (CPU copies)."""
        return {name: whole(p.grad.detach()).cpu().clone() for name, p in self.params.items() if p.grad is not None}

    def load_grad_tensors(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        unexpected = sorted(set(tensors) - set(self.params))
        if unexpected:
            raise InvalidRequestError(f"{source}: gradients for unknown parameters {unexpected[:3]}")
        self.zero_grad()
        for name, grad in tensors.items():
            param = self.params[name]
            param.grad = placed_like(grad.to(device=param.device, dtype=param.dtype).clone(), param)
