"""Slots of fixed shape for the recurrent states of hybrid families on the static-shape decode path.

Linear-attention and Mamba layers (Qwen3.5's gated delta net, Falcon-H1's and Nemotron-H's Mamba-2 mixers)
summarise a row's past in states of a fixed size, whatever its length: a conv state (the last `kernel`
inputs of the causal convolution, (channels, kernel)) and a recurrent state (the delta rule's or the
SSM's, (heads, ...)). So a slot is simply a row of a (rows, ...) buffer per layer and state:

- allocated once per bucket, on the first `fill_states`, with the prefill's dtypes (the recurrent state is
  fp32 whatever the model's dtype) and marked as static addresses like the KV buffers (`slot_cache`);
- a row joins by copying its prefilled states into its slot, and leaves by being marked free (a free
  slot's states keep evolving on garbage that nothing reads; a joining row overwrites them whole);
- a decode step updates every slot in place, through the methods HF's mixers call on their cache in a
  single-token step: `get_conv_state` and `get_recurrent_state` hand them the buffers, which their
  `causal_conv1d_update` and (Mamba) `mamba2_selective_state_update` overwrite in place, and the delta
  net's `update_recurrent_state` copies its new state into its buffer. No step reallocates a state, reads
  one on the host, or takes a branch that changes from one step to the next (`is_recording_past` is
  always False, and a layer's states are there from its rows' prefill on: the mixers take their decode
  branch at every step).
"""

from __future__ import annotations

import torch

States = dict[int, torch.Tensor | None]  # an HF linear-attention cache layer's conv or recurrent states, by index


class StateSlots:
    """Per recurrent layer and state index, its conv and recurrent states of shape (rows, ...), a row per slot."""

    def __init__(self, rows: int):
        self.rows = rows
        self.conv: dict[tuple[int, int], torch.Tensor] = {}
        self.recurrent: dict[tuple[int, int], torch.Tensor] = {}

    def fill_states(self, layer: int, slots: torch.Tensor, conv: States, recurrent: States) -> None:
        """Copy a prefill's states of one layer (n rows each; None: a state the layer does not keep) into
        `slots` (n,)."""
        for mine, theirs in ((self.conv, conv), (self.recurrent, recurrent)):
            for index, states in theirs.items():
                if states is not None:
                    _allocated(mine, (layer, index), self.rows, states)[slots] = states

    def move_states(self, other: StateSlots) -> None:
        """Copy every slot of `other` (a smaller bucket) into the same slots here."""
        for mine, theirs in ((self.conv, other.conv), (self.recurrent, other.recurrent)):
            for key, states in theirs.items():
                _allocated(mine, key, self.rows, states)[: other.rows] = states

    # What HF's linear-attention and Mamba mixers call on their cache in a decode step.

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get((layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get((layer_idx, state_idx))

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_):
        """A step's new states (every slot's), copied into the buffer so that its address stays."""
        states = self.recurrent[(layer_idx, state_idx)]
        states.copy_(recurrent_states.to(states.dtype))
        return states


def _allocated(
    buffers: dict[tuple[int, int], torch.Tensor], key: tuple[int, int], rows: int, like: torch.Tensor
) -> torch.Tensor:
    """The buffer at `key`, made if missing: (rows, *like's other axes) zeros of like's dtype, marked as a static
    address (a captured step updates it in place)."""
    if key not in buffers:
        buffers[key] = like.new_zeros((rows, *like.shape[1:]))
        torch._dynamo.mark_static_address(buffers[key])
    return buffers[key]
