"""One training session on an engine: where its trained weights are, its config, its AdamW and its step.

The weights are a name in the engine's `AdapterBank`: a LoRA adapter, or a full fine-tuning session's own weights
(`treadle.gpu_worker.model.full_weights`). What a checkpoint holds besides them is `TrainingState`
(`treadle.gpu_worker.training.state`): `state` writes it, `restore` reads it back into a fresh session.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.gpu_worker.model import full_weights
from treadle.gpu_worker.training.optimizer import SessionOptimizer
from treadle.gpu_worker.training.state import TrainingState, capture_rng
from treadle.gpu_worker.training.validation import check_same_adapter
from treadle.types import FullConfig, LoraConfig


@dataclass
class Session:
    adapter: str
    lora: LoraConfig
    optimizer: SessionOptimizer
    step: int = 0
    full: FullConfig | None = None  # a full fine-tuning session (`adapter` names its weights in the bank)
    memory: int = 0  # device bytes its trained weights hold: weights, gradients and moments

    def state(self, base_model: str, *, include_optimizer: bool) -> TrainingState:
        """Everything a checkpoint holds beside the weights, the process's RNG included."""
        return TrainingState(
            base_model=base_model,
            lora=self.lora,
            full=self.full,
            step=self.step,
            optimizer=self.optimizer.state_tensors() if include_optimizer else None,
            gradients=self.optimizer.grad_tensors(),
            rng=capture_rng(),
        )

    def check_loadable(self, state: TrainingState, *, source: str) -> None:
        """load_state into this live session keeps what it trains: the same kind, the same adapter's shape."""
        full_weights.check_same_kind(self.full, state.full, source=source)
        if state.full is None:
            check_same_adapter(self.lora, state.lora, source=source)

    def restore(self, state: TrainingState, *, source: str) -> None:
        """The step, and with the optimizer (read `with_optimizer`) Adam moments and pending gradients, exactly."""
        if state.optimizer is not None:
            self.optimizer.load_state_tensors(state.optimizer, source=source)
            self.optimizer.load_grad_tensors(state.gradients, source=source)
        self.step = state.step
