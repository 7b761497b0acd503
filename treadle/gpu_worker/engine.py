"""The worker's compute engine: one base model, loaded once, serving many training sessions.

Each session is one LoRA adapter (or a full session's own weights, `full_weights`) plus one AdamW on the shared base
model; each sampler a frozen snapshot of either, which the engine makes, loads, saves and drops in its bank. Which
snapshot serves which sampler id, and the sample and `compute_logprobs` requests on them (or on the bare base model),
are `engine.samplers` (`sampling/samplers.py`). The engine knows nothing of queues, ordering or storage: the Celery
worker calls these methods in each session's `seq` order, and the checkpoint store moves what `save_state` /
`save_sampler_weights` write.

Every method here that touches the model takes the fair `DeviceLock` (the active adapter is PeftModel-wide state;
the sampler's batched decode loop takes it per forward, so a training op waits at most one decode step); vLLM
samples in a child process, lock-free. Requests are validated before any tensor.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch

from treadle.errors import InvalidRequestError, SessionNotFoundError
from treadle.gpu_worker.model import full_weights
from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.model.full_memory import FullMemory
from treadle.gpu_worker.scheduling.cpu_threads import CpuThreads
from treadle.gpu_worker.scheduling.device_lock import DeviceLock, engine_lock, on_device
from treadle.gpu_worker.training.logprobs import Checkpointing, MemoryPlan, micro_batches, on_host, target_logprobs
from treadle.gpu_worker.training.losses import LOSSES
from treadle.gpu_worker.model.host import ModelHost, pick_device
from treadle.types.base import DEFAULT_MAX_IMAGE_PIXELS
from treadle.gpu_worker.model_profile import profile
from treadle.gpu_worker.training.optimizer import SessionOptimizer
from treadle.gpu_worker.sampling.backend import SamplerSetup
from treadle.gpu_worker.sampling.registry import SamplerKind, SamplerOptions, make_sampler
from treadle.gpu_worker.sampling.samplers import Samplers
from treadle.gpu_worker.training.session import Session
from treadle.gpu_worker.training.state import Checkpoint, read_checkpoint, restore_rng, write_state
from treadle.gpu_worker.training.validation import PreparedDatum, check_loss, prepare_data
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    FullConfig,
    LoraConfig,
    OptimStepResponse,
    TensorData,
)


T = TypeVar("T")


class Engine:
    """One base model (loaded once) serving many sessions: one PEFT LoRA adapter + one AdamW per session."""

    def __init__(
        self,
        model: str,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_tokens_per_microbatch: int | None = None,
        activation_checkpointing: Checkpointing = "auto",
        sampling_max_batch_tokens: int = 16384,
        sampling_prefix_cache_tokens: int = 16384,
        sampler: SamplerKind = "hf",
        sampler_options: SamplerOptions | None = None,
        shard: bool = False,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        full_session_memory: int = 0,
    ):
        self._lock = engine_lock(pick_device(device), shared=shard)
        # Loaded where it will compute: a load's parallel copies on this thread would give it a thread pool of its own.
        with self._lock:
            self._host = self._lock.run(
                ModelHost, model, device=device, dtype=dtype, shard=shard, max_image_pixels=max_image_pixels
            )
        self._bank = AdapterBank(self._host)
        self._sessions: dict[str, Session] = {}
        self.base_model = model
        self.max_seq_len = self._host.max_seq_len
        self.vocab_size = self._host.vocab_size
        self.tokenizer = self._host.tokenizer
        self.vision = self._host.vision  # a vision-language model's image path (None: a text model)
        self._limits = dict(max_seq_len=self.max_seq_len, vocab_size=self.vocab_size, vision=self.vision)
        self.memory_plan = MemoryPlan.of(self._host, max_tokens_per_microbatch, activation_checkpointing)
        self.max_tokens_per_microbatch = self.memory_plan.budget
        # Family, LoRA targets, sampler path; a model treadle cannot serve is refused here (`model_profile`). Its
        # smoke forwards run where the model computes too, for the same reason as the load.
        images = self.vision is not None and not self.vision.refused
        dtype_name = str(self._host.dtype).removeprefix("torch.")
        with self._lock:
            self.profile = self._lock.run(profile, self._host.model, self._host.targets, dtype_name, images=images)
        setup = SamplerSetup(
            self._bank,
            self._host,
            self._lock,
            max_batch_tokens=sampling_max_batch_tokens,
            max_forward_tokens=self.max_tokens_per_microbatch,
            hf_batching=self.profile.sampler,
            static_decode=self.profile.static_decode,
            vllm_serves=self.profile.vllm,
            prefix_cache_tokens=sampling_prefix_cache_tokens,
        )
        self.samplers = Samplers(make_sampler(sampler, setup, sampler_options), self._host)
        self._threads = CpuThreads(self._host.device)
        self._base_params = sum(p.numel() for p in self._host.model.parameters())
        self.full_memory = FullMemory(self._host, self.max_tokens_per_microbatch, full_session_memory, sharded=shard)

    # ------------------------------------------------------------ sessions

    @property
    def device(self) -> DeviceLock:
        """The lock every method here takes (reentrant): the op loop holds it from one op to the next while their
        sessions are owed the device (treadle.gpu_worker.scheduling.turns.HeldDevice)."""
        return self._lock

    @on_device
    def create_session(self, session_id: str, lora: LoraConfig, full: FullConfig | None = None) -> None:
        """A LoRA session (`lora`), or a full fine-tuning one (`full` set; refused if its memory does not fit)."""
        if session_id in self._sessions:
            raise InvalidRequestError(f"session_id: {session_id!r} already exists")
        self._sessions[session_id] = self._new_session(lora, full)

    def _new_session(self, lora: LoraConfig, full: FullConfig | None = None, *, replacing: int = 0) -> Session:
        adapter = self._bank.new_name()
        if full is not None:
            self._bank.add_full(adapter, self.full_memory.admitted(full, self._full_held() - replacing))
        else:
            self._bank.add(adapter, self._bank.lora_config(lora), seed=lora.seed)
        optimizer = SessionOptimizer(self._bank.parameters(adapter))
        memory = self._bank.full[adapter].state_bytes if full else 16 * optimizer.size  # fp32: weights, grads, moments
        return Session(adapter=adapter, lora=lora, optimizer=optimizer, full=full, memory=memory)

    def _full_held(self) -> int:
        """Bytes the full sessions and their sampler snapshots hold on this rank, as admission counts them."""
        return sum(weights.held_bytes for weights in self._bank.full.values())

    def session_memory(self, session_id: str) -> int:
        """Bytes the session's trained weights hold on the device: weights, gradients and AdamW moments."""
        return self._session(session_id).memory

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    @on_device
    def drop_session(self, session_id: str) -> None:
        """Free the session's adapter, optimizer state and gradients."""
        session = self._session(session_id)
        session.optimizer.zero_grad()
        self._bank.remove(session.adapter)
        del self._sessions[session_id]

    def step(self, session_id: str) -> int:
        """Optimizer steps applied so far."""
        return self._session(session_id).step

    def trainable_parameters(self, session_id: str) -> dict[str, torch.nn.Parameter]:
        """The session's adapter parameters by portable name, as its optimizer holds them (gradients included)."""
        return self._session(session_id).optimizer.params

    def _session(self, session_id: str) -> Session:
        if session_id not in self._sessions:
            raise SessionNotFoundError(f"session_id: no session {session_id!r} on base model {self.base_model}")
        return self._sessions[session_id]

    # ------------------------------------------------------------ training ops

    def forward(
        self, session_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        """Logprobs and loss without gradients (what a client-side custom loss needs)."""
        return self._checked_run(session_id, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, session_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        """Like `forward`, and adds the loss's gradients to the session's accumulated gradients."""
        return self._checked_run(session_id, data, loss_fn, loss_fn_config, backward=True)

    def _checked_run(
        self, session_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, *, backward: bool
    ) -> ForwardBackwardOutput:
        with self.device:
            # Everything is validated before the model runs, so a rejected request leaves no gradients.
            session = self._session(session_id)
            config = check_loss(loss_fn, loss_fn_config)
            prepared = prepare_data(data, loss_fn, **self._limits)
            work = sum(d.length for d in prepared) * self._base_params
            return self._compute(work, self._run, session, prepared, loss_fn, config, backward=backward)

    def _compute(self, work: float, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` for a holder of the device lock, on threads sized to its `work`: toy-sized work on
        one thread of this one (it starts no OpenMP team, so it needs no hand-off) unless large work has just run,
        the rest where the lock computes (treadle.gpu_worker.scheduling.cpu_threads)."""
        return self._threads.compute(work, self.device.run, fn, *args, **kwargs)

    def _run(
        self,
        session: Session,
        prepared: list[PreparedDatum],
        loss_fn: str,
        config: dict[str, float],
        *,
        backward: bool,
    ) -> ForwardBackwardOutput:
        spec, device = LOSSES[loss_fn], self._host.device
        outputs: list[dict[str, TensorData]] = [{} for _ in prepared]
        micro_losses = []  # read back once, after the last micro-batch: each read waits for the device
        with self._bank.using(session.adapter, trainable=backward) as model, torch.set_grad_enabled(backward):
            for group in micro_batches([d.length for d in prepared], self.max_tokens_per_microbatch):
                batch = [prepared[i] for i in group]
                logprobs = target_logprobs(
                    model,
                    [d.tokens for d in batch],
                    [d.inputs["target_tokens"] for d in batch],
                    device=device,
                    pad_token_id=self._host.pad_token_id,
                    vision=self.vision,
                    visuals=[d.visual for d in batch],
                    needs_grad=[d.gated(spec.gradient_gate) for d in batch]
                    if backward and spec.gradient_gate
                    else None,
                    plan=self.memory_plan,
                )
                # Flat, like the logprobs below: an [N, K] input's K values a position follow each other.
                inputs = {
                    key: torch.from_numpy(np.concatenate([d.inputs[key].reshape(-1) for d in batch])).to(device)
                    for key in spec.inputs
                }
                if spec.per_sequence:
                    inputs["sequence_index"] = torch.repeat_interleave(
                        torch.arange(len(batch), device=device),
                        torch.tensor([len(lp) for lp in logprobs], device=device),
                    )
                flat = torch.cat([lp.reshape(-1) for lp in logprobs])
                loss = spec.fn(flat, inputs, config)
                if backward:
                    loss.backward()
                micro_losses.append(loss.detach())
                for i, values in zip(group, on_host(flat, logprobs)):
                    outputs[i] = {"logprobs": TensorData.from_numpy(values)}
        loss_sum = sum(torch.stack(micro_losses).cpu().tolist())
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": loss_sum})

    def optim_step(self, session_id: str, params: AdamParams) -> OptimStepResponse:
        """Apply the accumulated gradients with AdamW(params) and clear them."""
        with self.device:
            session = self._session(session_id)
            metrics = self._compute(10 * session.optimizer.size, session.optimizer.step, params)
            session.step += 1
        return OptimStepResponse(metrics={**metrics, "step:max": float(session.step)})

    # ------------------------------------------------------------ samplers

    @on_device
    def snapshot_sampler(self, session_id: str, sampler_id: str) -> None:
        """A frozen copy of the session's adapter as it is now; later training never changes it."""
        session = self._session(session_id)
        self._check_new_sampler(sampler_id, list(self._bank.parameters(session.adapter)) if session.full else None)
        adapter = self._bank.new_name()
        self._bank.add_copy(adapter, source=session.adapter)
        self.samplers.add(sampler_id, adapter)

    @on_device
    def load_sampler(self, sampler_id: str, adapter_dir: str | full_weights.FullSnapshot) -> None:
        """A frozen sampler from a PEFT adapter directory (or a full session's snapshot: a model directory, or read)."""
        self._check_new_sampler(sampler_id, full_weights.snapshot_names(adapter_dir))
        adapter = self._bank.new_name()
        self._bank.add_from_dir(adapter, adapter_dir)
        self.samplers.add(sampler_id, adapter)

    def _check_new_sampler(self, sampler_id: str, full_names: list[str] | None) -> None:  # None: a LoRA adapter
        if sampler_id in self.samplers:
            raise InvalidRequestError(f"sampler_id: {sampler_id!r} already exists")
        self.full_memory.check_snapshot(
            self.samplers.backend.path, sampler_id, names=full_names, held=self._full_held()
        )

    def drop_sampler(self, sampler_id: str) -> None:
        """Serve the sampler no more, and free its snapshot once no queued or running request needs it."""
        with self._lock:  # before the samplers' catalog lock, as everywhere
            self.samplers.drop(sampler_id, then=self._bank.remove)

    def close(self) -> None:
        """Stop the sampler thread (unanswered sample requests fail)."""
        self.samplers.backend.close()

    # ------------------------------------------------------------ state

    @on_device
    def save_state(self, session_id: str, directory: str, *, include_optimizer: bool = True) -> None:
        """Adapter (PEFT format; a full session's: a model directory), moments, gradients, step, config and RNG."""
        session = self._session(session_id)
        self._bank.save(session.adapter, directory)
        write_state(directory, session.state(self.base_model, include_optimizer=include_optimizer))

    @on_device
    def load_state(self, session_id: str, directory: str | Checkpoint, *, with_optimizer: bool) -> None:
        """Create (or replace) the session from a state directory (or its `Checkpoint`, read).

        with_optimizer=True restores Adam moments, pending gradients and the RNG exactly, or raises;
        False loads the weights and step count and starts Adam afresh. Everything is loaded into a new
        adapter first, so a failed load leaves an existing session untouched.
        """
        read = directory if isinstance(directory, Checkpoint) else read_checkpoint(directory, with_optimizer)
        current, state, source = self._sessions.get(session_id), read.state, read.source
        if current is not None:
            current.check_loadable(state, source=source)
        fresh = self._new_session(state.lora, state.full, replacing=current.memory if current else 0)
        try:
            self._bank.load_weights(fresh.adapter, read.weights, source=source)
            fresh.restore(state, source=source)
        except Exception:
            self._bank.remove(fresh.adapter)
            raise
        if session_id in self._sessions:
            self.drop_session(session_id)
        self._sessions[session_id] = fresh
        if with_optimizer and state.rng:
            restore_rng(state.rng)

    @on_device
    def save_sampler_weights(self, sampler_id: str, directory: str) -> None:
        """The sampler's adapter as a PEFT directory (adapter only); a full session's snapshot as a model directory."""
        self._bank.save(self.samplers.adapter(sampler_id), directory)
