"""One handler per session op: what the worker does with a typed request, given a small context.

A handler takes the op's request (already decoded from the journal into its class from
`treadle.queue.ops`) and an `OpContext` (the engine serving the session, the session, the op's seq,
the checkpoint store, the sampler cache and the fence), and returns the op's typed response. It never
sees the sequencer or the worker. `HANDLERS` maps each request class to its handler; `handler_for`
looks one up before anything runs, so an error inside a handler is reported as that error, never as
an unknown op.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from treadle.errors import CheckpointExistsError, ServerError
from treadle.gpu_worker.sessions.checkpoint_io import load_checkpoint
from treadle.gpu_worker.sessions.external_export import export_adapter
from treadle.observability import metrics
from treadle.queue.ops import (
    EmptyResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    NoopRequest,
    OpRequest,
    OptimStepRequest,
    SaveStateRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    StopRequest,
    op_request,
)
from treadle.queue.sessions import SessionRecord
from treadle.storage.checkpoint_store import CheckpointStore
from treadle.storage.paths import CheckpointPath
from treadle.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)


@dataclass(frozen=True)
class OpContext:
    engine: "Engine"  # noqa: F821 - treadle.gpu_worker.engine.Engine; not imported to keep this module light
    session: SessionRecord
    seq: int
    store: CheckpointStore
    fence: Callable[[], None]  # raises if this worker lost the session's lease; called before every write
    remember_sampler: Callable[[str, str], None]  # (sampler id, base model): the sampler cache's bookkeeping

    @property
    def session_id(self) -> str:
        return self.session.session_id


Handler = Callable[[OpRequest, OpContext], BaseModel]
HANDLERS: dict[type[OpRequest], Handler] = {}


def handles(request_cls: type[OpRequest]):
    def register(fn: Handler) -> Handler:
        HANDLERS[request_cls] = fn
        return fn

    return register


def handler_for(op: str) -> Handler:
    cls = op_request(op)
    if cls not in HANDLERS:
        raise ServerError(f"op: {op!r} has no handler on this worker (a newer client than worker?)")
    return HANDLERS[cls]


@handles(ForwardRequest)
@handles(ForwardBackwardRequest)
def forward(req: ForwardRequest, ctx: OpContext) -> ForwardBackwardOutput:
    run = ctx.engine.forward_backward if req.stateful else ctx.engine.forward
    out = run(ctx.session_id, req.data, req.loss_fn, req.loss_fn_config)
    return out.model_copy(update={"metrics": {**out.metrics, "step:max": float(ctx.engine.step(ctx.session_id))}})


@handles(OptimStepRequest)
def optim_step(req: OptimStepRequest, ctx: OpContext) -> OptimStepResponse:
    return ctx.engine.optim_step(ctx.session_id, req.adam_params)


@handles(SaveStateRequest)
def save_state(req: SaveStateRequest, ctx: OpContext) -> SaveWeightsResponse:
    path = CheckpointPath(run_id=ctx.session.run_id, kind="weights", name=req.name)
    if not req.overwrite and ctx.store.exists(path):
        raise CheckpointExistsError(f"name: checkpoint {path.uri()} exists and overwrite=False")
    with tempfile.TemporaryDirectory(prefix="treadle-state-") as tmp:
        ctx.engine.save_state(ctx.session_id, tmp, include_optimizer=True)
        _store(
            ctx,
            tmp,
            path,
            "state",
            ttl_seconds=req.ttl_seconds,
            user_metadata=req.user_metadata,
            overwrite=req.overwrite,
        )
    return SaveWeightsResponse(path=path.uri())


def _store(ctx: OpContext, tmp: str, path: CheckpointPath, kind: str, **options) -> None:
    """Store the checkpoint written to `tmp` as `path`, with the session's provenance (once the lease is checked:
    a worker that lost the session must not overwrite what its new owner saves), and time it."""
    ctx.fence()
    started = time.monotonic()
    manifest = ctx.store.save(
        tmp,
        path,
        base_model=ctx.session.base_model,
        step=ctx.engine.step(ctx.session_id),
        applied_seq=ctx.seq,
        **_provenance(ctx.session, base_model_path=ctx.engine.base_model),
        **options,
    )
    metrics.observe_checkpoint(kind, time.monotonic() - started, manifest.size_bytes)


def _provenance(session: SessionRecord, **extra) -> dict:
    """What a checkpoint's manifest says it holds: the LoRA config of an adapter, or (in `extra`) the full config of
    a full fine-tuning session's weights, whose directory is a whole model."""
    if session.full is not None:
        return {"lora_config": None, "extra": {**extra, "full_config": session.full.model_dump()}}
    return {"lora_config": session.lora.model_dump(), "extra": extra}


@handles(SaveWeightsForSamplerRequest)
def save_weights_for_sampler(req: SaveWeightsForSamplerRequest, ctx: OpContext) -> SaveWeightsForSamplerResponse:
    ephemeral = req.name is None  # an empty name is a bad name, not a request for a generated one
    name = f"ephemeral-{ctx.seq:08d}" if ephemeral else req.name
    ttl = req.ttl_seconds or (24 * 3600 if ephemeral else None)
    path = CheckpointPath(run_id=ctx.session.run_id, kind="sampler_weights", name=name)
    sampler_id = path.uri()
    ctx.engine.snapshot_sampler(ctx.session_id, sampler_id)
    ctx.remember_sampler(sampler_id, ctx.session.base_model)
    with tempfile.TemporaryDirectory(prefix="treadle-sampler-") as tmp:
        ctx.engine.save_sampler_weights(sampler_id, tmp)
        if req.merge_weights and ctx.session.full is None:  # a full session's directory is a whole model already
            from treadle.storage.merged_export import export_merged  # transformers' full model load: only when asked

            export_merged(ctx.engine.base_model, tmp, f"{tmp}/merged")
        _store(ctx, tmp, path, "sampler", ttl_seconds=ttl, overwrite=True)
    return SaveWeightsForSamplerResponse(path=sampler_id)


@handles(SaveWeightsExternalRequest)
def save_weights_external(req: SaveWeightsExternalRequest, ctx: OpContext) -> SaveWeightsExternalResponse:
    path = CheckpointPath(run_id=ctx.session.run_id, kind="external_weights", name=req.name)
    with tempfile.TemporaryDirectory(prefix="treadle-export-") as tmp:
        ctx.engine.save_state(ctx.session_id, f"{tmp}/state", include_optimizer=False)
        export_adapter(f"{tmp}/state", f"{tmp}/out", req.age_encryption_recipients)
        ctx.fence()
        manifest = ctx.store.save(
            f"{tmp}/out",
            path,
            base_model=ctx.session.base_model,
            step=ctx.engine.step(ctx.session_id),
            applied_seq=ctx.seq,
            ttl_seconds=req.ttl_seconds,
            overwrite=True,
            **_provenance(ctx.session, encrypted=bool(req.age_encryption_recipients)),
        )
    return SaveWeightsExternalResponse(path=path.uri(), size_bytes=manifest.size_bytes)


@handles(LoadStateRequest)
def load_state(req: LoadStateRequest, ctx: OpContext) -> LoadWeightsResponse:
    load_checkpoint(ctx.engine, ctx.store, ctx.session_id, req.path, req.with_optimizer)
    return LoadWeightsResponse(path=req.path, model_id=ctx.session_id)


@handles(NoopRequest)
@handles(StopRequest)
def nothing(req: OpRequest, ctx: OpContext) -> EmptyResponse:
    """noop does nothing; stop's work (freeing the session) is the sequencer's, after the result is stored."""
    return EmptyResponse()
