"""What switching the active LoRA adapter costs when sessions take turns on one worker.

Every training op runs with its session's adapter active, so when two sessions take turns each op starts
with a switch. The bank (`treadle/gpu_worker/model/adapters.py`) switches by touching only the adapter that
was active and the new one; PEFT's `set_adapter` walks every module and sets the flags of every adapter's
tensors. Both are timed alternating between two adapters (median of `--switches` switches, one thread), on the
tiny random Llama with 2 decoder layers and the same with 32 (a 7-8B model's depth), with 2 and 8 adapters
loaded (every linear adapted, lm_head too).

    .venv/bin/python benchmarks/adapter_switch.py [--switches 400]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from treadle.gpu_worker.model.adapters import AdapterBank
from treadle.gpu_worker.model.host import ModelHost
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import LoraConfig


def with_layers(directory: str, layers: int) -> str:
    """The tiny model at `directory`, re-initialised with `layers` decoder layers."""
    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers = layers
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def median_switch_ms(switch, first: str, second: str, switches: int) -> float:
    times = []
    for i in range(switches):
        started = time.perf_counter()
        switch(second if i % 2 else first)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switches", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| decoder layers | adapters | PEFT set_adapter | treadle's switch | ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (2, 32):
            path = with_layers(build_tiny_model(f"{tmp}/tiny{layers}", arch="llama", seed=0), layers)
            for adapters in (2, 8):
                bank = AdapterBank(ModelHost(path, dtype="float32"))
                names = [bank.new_name() for _ in range(adapters)]
                for seed, name in enumerate(names):
                    bank.add(name, bank.lora_config(LoraConfig(rank=8)), seed=seed)

                def ours(name: str) -> None:
                    with bank.using(name, trainable=True):
                        pass

                def peft_own(name: str) -> None:
                    bank.peft_model.set_adapter(name, inference_mode=False)

                ours_ms = median_switch_ms(ours, names[0], names[1], args.switches)
                theirs_ms = median_switch_ms(peft_own, names[0], names[1], args.switches)  # after: it bypasses the bank
                print(f"| {layers} | {adapters} | {theirs_ms:.3f} ms | {ours_ms:.3f} ms | {theirs_ms / ours_ms:.0f}x |")


if __name__ == "__main__":
    main()
