"""What one decode step of the sampler costs, in-process, against the model's own attention and HF `generate`.

The rows: `--prompts` chat prompts of different lengths x `--samples` samples (32 rows by default),
decoding with no stop, T=1. Median milliseconds per decode step, rounds alternating the rows:

1. treadle, base model: the batch-invariant decode step (`row_invariant`: one attention call per layer);
2. the model's own SDPA attention on the same rows and cache (a plain transformers forward: not
   batch-invariant);
3. HF `generate` on the same rows, per step ((time of N tokens - time of 1) / (N - 1));
4. treadle with one LoRA adapter on every row, and with `--sessions` adapters on as many runs of rows
   (`mixed_lora`'s grouped products);
5. the ceiling of many sessions: `--sessions` steps of (rows / sessions) rows against one step of all
   the rows, base model: what batching the sessions can gain at most.

Treadle's steps include drawing the tokens; 2 is the bare forward. For 1, 2 and 4 it also counts the torch
operators one step dispatches (top-level aten calls, torch.profiler): on a GPU each is about one kernel launch, and
a small model's decode step is bound by launches, so the count is that cost, the same on any machine. The
accelerator rows count the step as a GPU runs it (`row_invariant.invariant_layouts`: no CPU-only layouts).

    .venv/bin/python benchmarks/decode_step.py [--prompts 8 --samples 4 --steps 16 --threads 2 --rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sampling import chat_prompts  # this directory's benchmarks/sampling.py


def treadle_steps(bank, prompts, adapters, samples, steps) -> list[float]:
    """Seconds of each of `steps` decode steps of a fresh batch (the prefill and first step untimed)."""
    from treadle.gpu_worker.sampling.backend import SampleJob
    from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch
    from treadle.gpu_worker.training.validation import prepare_sample
    from treadle.types import ModelInput, SamplingParams

    host = bank.host
    batch = DecodeBatch(bank, host)
    jobs = []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        params = SamplingParams(max_tokens=steps + 2, temperature=1.0, seed=i)
        request = prepare_sample(
            ModelInput.from_ints(prompt), samples, params, 0, max_seq_len=host.max_seq_len, vocab_size=host.vocab_size
        )
        jobs.append(SampleJob(adapter, request, samples, params, frozenset()))
    batch.admit(jobs)
    batch.step()
    return [timed(batch.step) for _ in range(steps)]


def left_padded(host, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows left-padded to one width: (input ids, attention mask)."""
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), host.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def sdpa_steps(host, prompts, samples, steps) -> list[float]:
    """Seconds of each of `steps` plain transformers forwards (the model's own attention) of the same rows."""
    from transformers import DynamicCache

    rows = [p for p in prompts for _ in range(samples)]
    ids, mask = left_padded(host, rows)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    times = []
    with torch.no_grad():
        out = host.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=DynamicCache(), use_cache=True
        )
        cache, last, position = out.past_key_values, out.logits[:, -1].argmax(-1), positions[:, -1]
        for step in range(steps + 1):
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            position = position + 1
            started = time.perf_counter()
            out = host.model(
                input_ids=last[:, None],
                attention_mask=mask,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            last = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1)[:, 0]
            if step:  # the first step is left out, as in treadle_steps
                times.append(time.perf_counter() - started)
            cache = out.past_key_values
    return times


def generate_step(host, prompts, samples, steps) -> float:
    """Seconds per decode step of HF `generate` on the same rows."""
    from transformers import GenerationConfig

    rows = [p for p in prompts for _ in range(samples)]
    ids, mask = left_padded(host, rows)

    def run(tokens: int) -> float:
        config = GenerationConfig(
            do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, top_k=0, pad_token_id=host.pad_token_id
        )
        with torch.no_grad():
            return timed(lambda: host.model.generate(input_ids=ids, attention_mask=mask, generation_config=config))

    return (run(steps + 1) - run(1)) / steps


def operators(step) -> int:
    """Top-level aten operators dispatched by `step()` (views and metadata calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(
        1
        for event in prof.events()
        if event.name.startswith("aten::")
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
    )


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts, of different lengths")
    parser.add_argument("--samples", type=int, default=4, help="rows per prompt")
    parser.add_argument("--sessions", type=int, default=4, help="adapters of the mixed rows (divides --prompts)")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per row and round")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (after a warm-up round)")
    parser.add_argument("--model_dir", default=None, help="default: SmolLM2-135M-Instruct, prepared offline")
    args = parser.parse_args()

    from treadle.demo.model import prepare_smollm2
    from treadle.gpu_worker.model.adapters import AdapterBank
    from treadle.gpu_worker.model.host import ModelHost
    from treadle.gpu_worker.sampling.hf import row_invariant
    from treadle.types import LoraConfig

    torch.set_num_threads(args.threads)
    host = ModelHost(args.model_dir or prepare_smollm2())
    bank = AdapterBank(host)
    names = [f"s{k}" for k in range(args.sessions)]
    for k, name in enumerate(names):
        bank.add(name, bank.lora_config(LoraConfig(rank=args.rank, alpha=args.rank)), seed=k)
    prompts = chat_prompts(host.tokenizer, args.prompts)
    n, per = args.prompts, args.prompts // args.sessions
    rows = {
        "treadle, base, one attention call": lambda s: treadle_steps(bank, prompts, [None] * n, args.samples, s),
        "model's own SDPA forward": lambda s: sdpa_steps(host, prompts, args.samples, s),
        "HF generate, per step": lambda s: [generate_step(host, prompts, args.samples, s)],
        "treadle, one adapter": lambda s: treadle_steps(bank, prompts, [names[0]] * n, args.samples, s),
        f"treadle, {args.sessions} adapters": lambda s: treadle_steps(
            bank, prompts, [names[i // per] for i in range(n)], args.samples, s
        ),
        f"base, {args.sessions} steps of {per * args.samples} rows": lambda s: [
            sum(
                statistics.median(treadle_steps(bank, prompts[k * per : (k + 1) * per], [None] * per, args.samples, s))
                for k in range(args.sessions)
            )
        ],
    }
    for fn in rows.values():  # warm-up
        fn(2)
    results: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            results[name].extend(fn(args.steps))
    ms = {name: 1000 * statistics.median(times) for name, times in results.items()}

    print(
        f"\ndecode step, {n} prompts x {args.samples} samples = {n * args.samples} rows, {args.threads} threads, "
        f"{args.rounds} rounds x {args.steps} steps (median ms per step)"
    )
    for name, value in ms.items():
        print(f"{name:<40}{value:>9.1f}")
    names_ = list(ms)
    print(f"\ninvariant step / the model's own SDPA:  {ms[names_[0]] / ms[names_[1]]:.2f}x the time")
    print(f"invariant step / HF generate's step:    {ms[names_[0]] / ms[names_[2]]:.2f}x the time")
    print(f"{args.sessions} adapters / one adapter:            {ms[names_[4]] / ms[names_[3]]:.2f}x the time")
    ceiling = ms[names_[5]] / ms[names_[0]]
    print(f"ceiling of {args.sessions} sessions at once (their steps apart / together): {ceiling:.2f}x")
    print(f"{args.sessions} adapters / the base model, same rows:      {ms[names_[4]] / ms[names_[0]]:.2f}x the time")
    print("\noperators dispatched per step (about one kernel launch each on a GPU):")
    counted = {
        "treadle, base": lambda s: treadle_steps(bank, prompts, [None] * n, args.samples, s),
        "treadle, one adapter": lambda s: treadle_steps(bank, prompts, [names[0]] * n, args.samples, s),
        f"treadle, {args.sessions} adapters": lambda s: treadle_steps(
            bank, prompts, [names[i // per] for i in range(n)], args.samples, s
        ),
        "model's own SDPA forward": lambda s: sdpa_steps(host, prompts, args.samples, s),
    }
    for name, fn in counted.items():  # one step more, the rest the same: the difference is one step's
        print(f"{name:<40}{operators(lambda: fn(3)) - operators(lambda: fn(2)):>9}")
    invariant_layouts = row_invariant.invariant_layouts
    row_invariant.invariant_layouts = lambda device: False  # what a step dispatches on an accelerator
    try:
        for name in ("treadle, base", "treadle, one adapter"):
            fn = counted[name]
            label = f"{name}, accelerator layouts"
            print(f"{label:<40}{operators(lambda: fn(3)) - operators(lambda: fn(2)):>9}")
    finally:
        row_invariant.invariant_layouts = invariant_layouts


if __name__ == "__main__":
    main()
