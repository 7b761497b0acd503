"""The SDK's `_async` twins: each has its sync method's signature, and each, awaited against the local
stack, gives what the sync method gives without blocking the event loop."""

from __future__ import annotations

import asyncio
import inspect
import typing

import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams
from treadle.errors import SessionStoppedError
from treadle.sdk import APIFuture, SamplingClient, ServiceClient, TrainingClient
from treadle.types import ForwardBackwardOutput, SampleResponse

CLASSES = (ServiceClient, TrainingClient, SamplingClient, APIFuture)
# Twins that resolve the sync method's future instead of returning it, as tinker's sampling twins do.
RESOLVING = {"SamplingClient.sample", "SamplingClient.compute_logprobs"}
# A liveness bound for one awaited twin on a loaded machine, not a speed claim.
LIVENESS_S = 300


def twins() -> dict[str, tuple[typing.Callable, typing.Callable]]:
    """`Class.method` -> (sync method, its `_async` twin), for every twin of the SDK's public classes."""
    found = {}
    for cls in CLASSES:
        for name, twin in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if name.endswith("_async"):
                found[f"{cls.__name__}.{name.removesuffix('_async')}"] = (
                    getattr(cls, name.removesuffix("_async")),
                    twin,
                )
    return found


@pytest.mark.parametrize("qualified", sorted(twins()))
def test_a_twin_has_its_methods_parameters_and_return_type(qualified):
    sync, twin = twins()[qualified]
    sync_sig, twin_sig = inspect.signature(sync, eval_str=True), inspect.signature(twin, eval_str=True)
    assert list(twin_sig.parameters.values()) == list(sync_sig.parameters.values()), (qualified, twin_sig, sync_sig)
    returns = sync_sig.return_annotation
    assert returns is not inspect.Signature.empty, f"{qualified} has no return type"
    if qualified in RESOLVING:
        assert typing.get_origin(returns) is APIFuture, qualified
        returns = typing.get_args(returns)[0]
    assert twin_sig.return_annotation == returns, (qualified, twin_sig.return_annotation, returns)


def test_every_sdk_op_has_a_twin():
    assert len(twins()) == 19  # 18 client ops, and APIFuture.result


def batch() -> list[Datum]:
    tokens = [5, 9, 14, 20, 27, 35, 44]
    return [
        Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]},
        )
    ]


def sum_of_logprobs(data, logprobs):
    """A client-side loss: minus the summed logprobs of every target token, weight or not."""
    return -sum(lp.sum() for lp in logprobs), {"datums": float(len(data))}


class Awaiter:
    """Awaits twins one by one, recording which were awaited, and that each let the event loop run meanwhile."""

    def __init__(self):
        self.awaited: set[str] = set()

    async def __call__(self, obj, method: str, *args, **kwargs):
        loop_ran: list[str] = []
        # A callback queued now runs before the twin returns only if the twin gave the loop control: a twin
        # doing its blocking call on the loop's thread returns first.
        # (`asyncio.timeout`, not `wait_for`: that runs the twin in a task of its own, which always yields first.)
        asyncio.get_running_loop().call_soon(loop_ran.append, "ran")
        async with asyncio.timeout(LIVENESS_S):
            value = await getattr(obj, f"{method}_async")(*args, **kwargs)
        assert loop_ran, f"{type(obj).__name__}.{method}_async returned without letting the event loop run"
        self.awaited.add(f"{type(obj).__name__}.{method}")
        return value


async def await_every_twin(service: ServiceClient) -> set[str]:
    call = Awaiter()
    capabilities = await call(service, "get_server_capabilities")
    assert "tiny" in [m.model_name for m in capabilities.supported_models]
    training = await call(service, "create_lora_training_client", "tiny", rank=4, seed=0)

    forward = await call(await call(training, "forward", batch()), "result")
    assert isinstance(forward, ForwardBackwardOutput)
    assert (await call(training, "forward_backward", batch(), "cross_entropy")).id.startswith(training.session_id)
    custom = await (await call(training, "forward_backward_custom", batch(), sum_of_logprobs))
    # No optimizer step between the two forwards: the custom loss is minus the forward's logprobs, summed.
    expected = -sum(float(lp) for out in forward.loss_fn_outputs for lp in out["logprobs"].to_numpy())
    assert custom.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5) and custom.metrics["datums:mean"] == 1.0
    # Ops reach the session in the order their twins were started, also when gathered.
    backward, step = await asyncio.gather(
        training.forward_backward_async(batch(), "cross_entropy"),
        call(training, "optim_step", AdamParams(learning_rate=1e-3)),
    )
    assert int(backward.id.rpartition(":")[2]) < int(step.id.rpartition(":")[2])
    await step

    saved = await (await call(training, "save_state", "async-twins"))
    await (await call(training, "load_state", saved.path))
    await (await call(training, "load_state_with_optimizer", saved.path))
    snapshot = await (await call(training, "save_weights_for_sampler", "async-twins-sampler"))
    assert snapshot.path.startswith("treadle://")
    sampler = await call(training, "save_weights_and_get_sampling_client")
    prompt = ModelInput.from_ints([5, 9, 14, 20])
    response = await call(sampler, "sample", prompt, 2, SamplingParams(max_tokens=4, seed=1))
    assert isinstance(response, SampleResponse) and len(response.sequences) == 2
    logprobs = await call(sampler, "compute_logprobs", prompt)
    assert logprobs[0] is None and len(logprobs) == prompt.length
    assert (await call(training, "get_usage")).ops > 0

    for method in ("create_training_client_from_state", "create_training_client_from_state_with_optimizer"):
        restored = await call(service, method, saved.path)
        assert restored.base_model == "tiny"
        restored.stop()
    full = await call(service, "create_full_training_client", "tiny")
    assert full.base_model == "tiny"
    full.stop()
    await call(training, "stop")
    with pytest.raises(SessionStoppedError):
        training.forward(batch())
    await training.stop_async()  # a second stop does nothing, as the sync one's
    return call.awaited


def test_every_twin_awaited_against_the_local_stack(service_client):
    assert asyncio.run(await_every_twin(service_client)) == set(twins())
