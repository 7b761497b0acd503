"""A model directory with random weights in the shapes of another's config: for a GPU machine that reaches no hub.

The benchmarks measure speed and sampler/trainer agreement, which a model's shapes decide, not its weights. Given
a directory with a config and a tokenizer (scripts/gpu_wheels.sh packs SmolLM2-135M-Instruct's), this writes
a checkpoint of the same architecture with transformers' own random init, in bf16, and copies the tokenizer.

    python benchmarks/random_weights.py CONFIG_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def random_weights(config_dir: str, out_dir: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(out_dir)
    model.save_pretrained(out)
    for f in Path(config_dir).iterdir():  # the tokenizer's files and the chat template
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return str(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_dir")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    print(random_weights(args.config_dir, args.out_dir))
