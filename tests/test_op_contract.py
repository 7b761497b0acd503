"""The op table is the one place an op is defined: handlers, task names, SDK decoders and gateway
renderers all follow from it. A fake op added to the table shows up in each of them."""

from __future__ import annotations

import json
import typing
from typing import ClassVar

import pytest
from celery import Celery
from pydantic import BaseModel

from treadle.gpu_worker.sessions import op_handlers
from treadle.gpu_worker.executor.celery_tasks import register_tasks
from treadle.gpu_worker.training.losses import LOSSES
from treadle.queue import ops
from treadle.types import LossFnType


class EchoResponse(BaseModel):
    text: str


class EchoRequest(ops.OpRequest):
    op: ClassVar[str] = "echo"
    response: ClassVar[type[BaseModel]] = EchoResponse
    text: str


@pytest.fixture()
def echo_op(monkeypatch):
    monkeypatch.setitem(ops.OPS, "echo", EchoRequest)
    monkeypatch.setitem(op_handlers.HANDLERS, EchoRequest, lambda req, ctx: EchoResponse(text=req.text))
    return EchoRequest


class _Stub:
    def on_doorbell(self, session_id: str, seq: int) -> None: ...

    def run(self, future_id: str) -> bool: ...


def test_the_loss_registry_and_loss_fn_type_name_the_same_losses():
    assert set(LOSSES) == set(typing.get_args(LossFnType))


def test_every_session_op_has_a_handler_and_every_op_a_response_type():
    for name, cls in ops.OPS.items():
        assert cls.op == name
        assert issubclass(cls.response, BaseModel)
        if cls.route == "session":
            assert op_handlers.handler_for(name) is op_handlers.HANDLERS[cls]
    assert {n for n, c in ops.OPS.items() if c.stateful} == {"forward_backward", "optim_step", "load_state"}


def test_a_new_op_appears_in_handlers_tasks_decoders_and_renderers(echo_op):
    from treadle.gateway.futures import render

    request = EchoRequest.build(text="hi")
    assert ops.op_request("echo") is EchoRequest
    assert EchoRequest.decode(request.encode()) == request
    assert op_handlers.handler_for("echo")(request, None) == EchoResponse(text="hi")
    # The worker registers one Celery task per op of the table.
    app = Celery("t", set_as_current=False)
    register_tasks(app, sequencer=_Stub(), control=_Stub())
    assert ops.task_name("echo") in app.tasks
    assert {ops.task_name(n) for n in ops.OPS} <= set(app.tasks)
    # The SDK decodes a stored result into the op's response type; the gateway renders it.
    stored = ops.encode_result("echo", EchoResponse(text="hi"))
    assert ops.decode_result(stored) == EchoResponse(text="hi")
    assert json.loads(render(ops.decode_result(stored)).body) == {"text": "hi"}


def test_an_unknown_op_and_a_bad_field_are_clear_errors():
    from treadle.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="op: unknown op 'nope'"):
        ops.op_request("nope")
    with pytest.raises(InvalidRequestError, match="loss_fn"):
        ops.ForwardRequest.build(data=[], loss_fn="hinge")
    with pytest.raises(InvalidRequestError, match="adam_params.learning_rate"):
        ops.OptimStepRequest.decode(b'{"adam_params": {"learning_rate": -1}}')


def test_tensors_cross_the_journal_as_raw_bytes_and_come_back_as_arrays():
    import numpy as np

    from treadle.types import Datum, ModelInput

    weights = np.linspace(0, 1, 1000, dtype=np.float32)
    datum = Datum(
        model_input=ModelInput.from_ints(range(1000)),
        loss_fn_inputs={"weights": weights, "target_tokens": np.arange(1000)},
    )
    raw = ops.ForwardBackwardRequest.build(data=[datum], loss_fn="cross_entropy").encode()
    assert b'"b64"' in raw and b"0.001" not in raw  # not a list of floats
    back = ops.ForwardBackwardRequest.decode(raw).data[0].loss_fn_inputs["weights"]
    assert "data" not in back.__dict__  # no Python list was made on the way
    np.testing.assert_array_equal(back.to_numpy(), weights)
