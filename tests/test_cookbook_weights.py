"""Acceptance: the cookbook's `weights.download` of a saved training checkpoint, through the gateway with only
TINKER_BASE_URL and TINKER_API_KEY set, gives a PEFT adapter directory that `PeftModel.from_pretrained`
loads, and that adapter computes the same logprobs as the served model it came from.

`weights.download` of a `weights/` path runs the whole external-weights path: a new training client from
the checkpoint, `save_weights_external` age-encrypted to a key it generates, signed per-file URLs fetched
without an API key, the TTL renewed, the files decrypted, and the temporary export deleted.
"""

from __future__ import annotations

import numpy as np
import tinker
import torch
from tinker import types as tt
from tinker_cookbook import weights

TEXT = "the cat is red and the dog is blue"


def test_weights_download_of_a_training_checkpoint_loads_with_peft(tinker_env, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    ids = tc.get_tokenizer().encode(TEXT)
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for _ in range(2):  # a trained adapter (LoRA B is zero at init), so equal logprobs mean the same weights
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result()
    served = np.asarray(tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    state_path = tc.save_state("to-download").result().path
    sc.close("success")

    out = weights.download(tinker_path=state_path, output_dir=str(tmp_path / "adapter"))
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    base_lp = _logprobs(base, ids)
    model = PeftModel.from_pretrained(base, out).eval()
    local = _logprobs(model, ids)
    np.testing.assert_allclose(local, served, rtol=1e-4, atol=1e-4)
    assert np.abs(local - base_lp).max() > 1e-3  # the adapter changed the model: this is not the base model

    # The temporary export is gone; the checkpoint it came from stays.
    rest = tinker.RestClient()
    paths = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert state_path in paths
    assert not [p for p in paths if p.endswith("/external_weights/download")]


def _logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
