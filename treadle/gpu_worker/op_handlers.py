"""One handler per op: what the worker does with a session's op, given its engine.

Each takes (ctx, engine, owned, env, payload): the executor (its checkpoint store and fencing), the
engine serving the session, the session's ownership record, the op envelope and its payload, and
returns the op's JSON result. Validation happens here, at the edge, before the engine is touched.
Adding an op: its request type in `queue/ops.py`, a handler here, a TrainingClient method, a gateway
route, a test row.
"""

from __future__ import annotations

import tempfile

from treadle.errors import CheckpointExistsError
from treadle.queue.ops import (
    ForwardBackwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    SaveSamplerRequest,
    SaveStateRequest,
    encode_forward_output,
    parse_request,
)
from treadle.storage.paths import CheckpointPath


def forward(ctx, engine, owned, env, payload):
    req = parse_request(ForwardBackwardRequest, payload, "forward")
    fn = engine.forward_backward if env.op == "forward_backward" else engine.forward
    out = fn(owned.record.session_id, req.datums(), req.loss_fn, req.loss_fn_config)
    return encode_forward_output(out, engine.step(owned.record.session_id))


def optim_step(ctx, engine, owned, env, payload):
    req = parse_request(OptimStepRequest, payload, "optim_step")
    out = engine.optim_step(owned.record.session_id, req.adam_params)
    return {"metrics": out.metrics or {}, "step": engine.step(owned.record.session_id)}


def save_state(ctx, engine, owned, env, payload):
    req = parse_request(SaveStateRequest, payload, "save_state")
    sid = owned.record.session_id
    path = CheckpointPath(run_id=owned.record.run_id, kind="weights", name=req.name)
    if not req.overwrite and ctx.store.exists(path):
        raise CheckpointExistsError(f"name: checkpoint {path.uri()} exists and overwrite=False")
    with tempfile.TemporaryDirectory(prefix="treadle-state-") as tmp:
        engine.save_state(sid, tmp, include_optimizer=True)
        ctx.fence(owned)
        ctx.store.save(tmp, path, base_model=owned.record.base_model, lora_config=owned.record.lora.model_dump(),
                        step=engine.step(sid), applied_seq=env.seq, ttl_seconds=req.ttl_seconds,
                        user_metadata=req.user_metadata, overwrite=req.overwrite,
                        extra={"base_model_path": engine.base_model})
    return {"path": path.uri()}


def save_weights_for_sampler(ctx, engine, owned, env, payload):
    req = parse_request(SaveSamplerRequest, payload, "save_weights_for_sampler")
    sid = owned.record.session_id
    ephemeral = req.name is None  # an empty name is a bad name, not a request for a generated one
    name = f"ephemeral-{env.seq:08d}" if ephemeral else req.name
    ttl = req.ttl_seconds or (24 * 3600 if ephemeral else None)
    path = CheckpointPath(run_id=owned.record.run_id, kind="sampler_weights", name=name)
    sampler_id = path.uri()
    engine.snapshot_sampler(sid, sampler_id)
    ctx.remember_sampler(sampler_id, owned.record.base_model)
    with tempfile.TemporaryDirectory(prefix="treadle-sampler-") as tmp:
        engine.save_sampler_weights(sampler_id, tmp)
        if req.merge_weights:
            from treadle.storage.merged_export import export_merged

            export_merged(engine.base_model, tmp, f"{tmp}/merged")
        ctx.fence(owned)
        ctx.store.save(tmp, path, base_model=owned.record.base_model, lora_config=owned.record.lora.model_dump(),
                        step=engine.step(sid), applied_seq=env.seq, ttl_seconds=ttl, overwrite=True,
                        extra={"base_model_path": engine.base_model})
    return {"path": sampler_id, "step": engine.step(sid)}


def load_state(ctx, engine, owned, env, payload):
    req = parse_request(LoadStateRequest, payload, "load_state")
    ctx.load_state_into(engine, owned.record.session_id, req.path, req.with_optimizer)
    return {"path": req.path, "step": engine.step(owned.record.session_id)}


def noop(ctx, engine, owned, env, payload):
    return {}

HANDLERS = {
    "forward": forward,
    "forward_backward": forward,
    "optim_step": optim_step,
    "save_state": save_state,
    "save_weights_for_sampler": save_weights_for_sampler,
    "load_state": load_state,
    "noop": noop,
    "stop": noop,
}
