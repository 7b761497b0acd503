"""A model directory with random weights in the shapes of another's config: for a GPU machine that reaches no hub.

The benchmarks measure speed and sampler/trainer agreement, which a model's shapes decide, not its weights. Given
a directory with a config and a tokenizer (scripts/gpu_wheels.sh packs SmolLM2-135M-Instruct's), this writes
a checkpoint of the same architecture with transformers' own random init, in bf16, and copies the tokenizer.

    python benchmarks/random_weights.py CONFIG_DIR OUT_DIR [--set hidden_size=2048 --set num_hidden_layers=24 ...]

`--set` changes fields of the config first: another model size of the same architecture and tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def random_weights(config_dir: str, out_dir: str, changes: dict[str, int] | None = None) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir, **(changes or {}))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(out_dir)
    model.save_pretrained(out)
    weights = (".safetensors", ".bin", ".gguf", ".pt", ".index.json")  # of a source that has them: not these
    for f in Path(config_dir).iterdir():  # the tokenizer's files and the chat template
        if f.is_file() and not f.name.endswith(weights) and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return str(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=INT", help="an integer config field")
    args = parser.parse_args()
    changes = {field: int(value) for field, value in (item.split("=", 1) for item in args.set)}
    print(random_weights(args.config_dir, args.out_dir, changes))
