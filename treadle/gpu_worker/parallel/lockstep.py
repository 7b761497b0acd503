"""A sharded group's ranks in lockstep: every rank runs the same FSDP units in the same order.

A sharded unit's forward starts with an all-gather of its weights (its backward with another), a collective
that every rank must enter (treadle.gpu_worker.model.sharding). Ranks hold different data, so two things
would break the order:

- a training op's shards differ in micro-batches (a rank may even have no datum): the group's rank 0 counts
  them for every rank before any runs (`rounds`), and a rank with fewer runs `idle_pass`es, one forward (and
  backward) of one token through every unit, for the ones it lacks;
- rank 0 alone runs every other forward (the sampler's prefills and decode steps, `compute_logprobs`, the
  logprob audit): a pre-forward hook on its model (`Mirror`) first tells each follower to run one
  no-grad `idle_pass`, whose all-gathers meet rank 0's, before rank 0's own begin. A forward with a full
  session's snapshot (whose weights rank 0 has swapped into its base shards, `AdapterBank.swapped`) names the
  snapshot, and each follower's idle pass swaps in its own shards of it: the weights gathered are the snapshot's
  on every rank, and each rank's base shards are back when its pass ends.

Every unit is sharded on every rank when an op or a forward of rank 0's alone begins (`reshard_all`): the
followers reshard after loading and at the end of each call, rank 0 at the start of each (its last forward
may have left the root whole for a loss that calls the output projection after it, or a state dict read may
have resharded it).

An idle pass changes nothing: its loss is zero times its logits, so it adds exact zeros to the gradients, and
no model in treadle draws random numbers in a forward (no dropout).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from treadle.gpu_worker.model.sharding import reshard_all
from treadle.gpu_worker.training.logprobs import micro_batches


def rounds_of(shards: list[list[int]], budget: int) -> list[int]:
    """Micro-batches of each rank's shard (token lengths), as the engine cuts them (`micro_batches`)."""
    return [len(micro_batches(lengths, budget)) if lengths else 0 for lengths in shards]


def idle_pass(engine, adapter: str | None, *, backward: bool) -> None:
    """This rank's share of the collectives of one micro-batch it does not hold: a one-token forward (and backward)
    with `adapter` (a session's, trainable when `backward`: the same units then have a backward on every rank; a
    full session's snapshot, whose shards the forward computes with). None: the bare base model, no gradients."""
    with engine.device:
        engine.device.run(_idle_pass, engine, adapter, backward)


def end_of_op(engine) -> None:
    """Every unit sharded again, as on every other rank (`reshard_all`)."""
    reshard_all(engine._host.model)


def _idle_pass(engine, adapter: str | None, backward: bool) -> None:
    # The engine's own bank and host: an idle pass must go through exactly the modules a real one does.
    bank, host = engine._bank, engine._host
    tokens = torch.full((1, 1), host.pad_token_id, dtype=torch.long, device=host.device)
    with bank.using(adapter, trainable=backward) as model, torch.set_grad_enabled(backward):
        logits = model(input_ids=tokens, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()


class Mirror:
    """Rank 0's hook on its sharded model: every forward it runs outside a group op is first announced to the
    followers (`announce`, which names the full snapshot the forward computes with, if any), so that they run an
    idle pass beside it. Group ops run inside `group_op()`.

    Such a forward that raises part-way (out of memory, say) leaves the followers inside a collective rank 0 will
    never enter, and the next forward's collectives would pair with it: `fail` takes the group down at once."""

    def __init__(self, model: torch.nn.Module, announce: Callable[[], None], fail: Callable[[str], None]):
        self._announce = announce
        self._fail = fail
        self._in_group_op = False
        # Before FSDP's own pre-forward hook (which gathers the root's weights): the followers must be on their way.
        model.register_forward_pre_hook(self._before_forward, prepend=True)
        # Called when the forward raised too, with no result (torch's `always_call`).
        model.register_forward_hook(self._after_forward, always_call=True)
        self._model = model

    def _before_forward(self, module, args) -> None:
        if not self._in_group_op:
            # Rank 0's root may still be whole from its last forward (its loss calls the output projection after
            # the model's forward); the followers' are sharded, their idle passes ended so.
            reshard_all(module)
            self._announce()

    def _after_forward(self, module, args, result) -> None:
        if result is None and not self._in_group_op:
            self._fail("a forward of rank 0's alone raised part-way; its followers wait in a collective it left")

    @contextmanager
    def group_op(self) -> Iterator[None]:
        """Within the block, the model's forwards are those of a group op, which every rank runs itself."""
        if not self._in_group_op:
            reshard_all(self._model)  # as at any forward of rank 0's (`_before_forward`)
        previous, self._in_group_op = self._in_group_op, True
        try:
            yield
        finally:
            self._in_group_op = previous
