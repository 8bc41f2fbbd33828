"""The load-balancing loss of Megatron's MoE routers, read as they attach it (for `train/moe_aux_loss`).

Megatron computes the Switch Transformer loss inside each MoE layer's router (`--moe-aux-loss-coeff` with
`--moe-router-load-balancing-type aux_loss`: E · Σ_e f_e · P_e, f_e the share of the layer's routed token slots
that go to expert e, P_e its mean router probability; 1 when the experts share the tokens evenly) and injects
coeff × loss into the backward pass itself. It reports the values only to its own trackers, whose API changed
between megatron-core 0.16 and 0.19; here each router's `attach_and_log_load_balancing_loss`, the one call both
versions route the loss through, is wrapped on the model's own router instances to keep the values of the
forward that is running.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOSS_NAME = "load_balancing_loss"  # Megatron's name for the aux_loss type's value


class RouterLossRecorder:
    """The load-balancing loss of every MoE layer in the forward passes since `clear()`."""

    def __init__(self, modules: list[torch.nn.Module]):
        from megatron.core.transformer.moe.router import Router

        self.losses: list[Tensor] = []
        self.routers = [m for module in modules for m in module.modules() if isinstance(m, Router)]
        for router in self.routers:
            router.attach_and_log_load_balancing_loss = self._recording(router.attach_and_log_load_balancing_loss)

    def _recording(self, attach):
        def attach_and_record(activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs):
            if aux_loss_name == _LOSS_NAME:
                self.losses.append(aux_loss.detach() / aux_loss_coeff)
            return attach(activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs)

        return attach_and_record

    def clear(self) -> None:
        self.losses.clear()

    def layer_mean(self) -> float | None:
        """The mean over this pipeline stage's MoE layers of the forward just run (None: no loss was computed,
        e.g. a stage without MoE layers, or the coefficient is 0)."""
        if not self.losses:
            return None
        return float(torch.stack(self.losses).mean())
