"""One GRPO step through treadle against the same step written in-process and against TRL, side by side in one run.

The step: sample `--samples` completions of each of `--prompts` arithmetic problems (T=1, up to `--tokens`
tokens), reward right answers, centre the rewards per group (uniform groups still train, with A = 0),
train with `importance_sampling`, take one AdamW step, and sample the next step from the new weights.
Each mode is one loop shape:

- `treadle`: the loop shape users run, `treadle.recipes.math_rl`'s: the `--prompts` sample futures submitted
  at once on a frozen snapshot, each group rewarded as it arrives and its own `forward_backward` submitted
  at once (so training one group overlaps sampling the next), `optim_step`, then a new sampler snapshot.
- `treadle_batched`: the same, but one `forward_backward` over every completion after the last group
  arrives (the shape this script measured before: its 1.10x; the math_rl shape measured 1.32x then).
- `hand`: a hand-written loop in a separate process: one batched HF `generate` of every row on a PEFT
  LoRA model, one padded forward/backward with the same loss, `torch.optim.AdamW`; no snapshot (it
  samples from the live adapter).
- `trl`: TRL's `GRPOTrainer` in a separate process (`pip install -e '.[bench]'`), the same batch
  (`num_generations` = samples), LoRA on every linear layer, beta 0, no clipping of the gradient norm, no activation checkpointing.

Each mode keeps its process (and model) for the whole run. The baselines hand their freed memory back to the
system after each step (`malloc_trim`, after the step's split is taken): each process otherwise keeps its peak
(the worker ~9 GB, the hand loop ~8 GB, TRL ~6 GB), and the three outgrew a 24 GB machine. (Capping glibc's
mmap threshold instead made the worker's per-group calls 1.8x slower.) Rounds alternate the modes, in a rotating
order, so the machine's drift hits all alike, and a warm-up round is left out. The split is what the
loop waits on: `sampling` (blocked on samples; through treadle in the math_rl shape this includes the
worker training earlier groups meanwhile), `training` (blocked on forward_backward and optim_step after
the last group), `snapshot` (save_weights_and_get_sampling_client), `client` (rewards, datums, submits).
Ratios are medians over rounds of the per-round ratios.

`--calls` measures the training half alone: the same 32 rows (fixed completions of random tokens, of
`--tokens`/3 to `--tokens` tokens) as `--prompts` per-group forward_backward calls submitted at once against
one call, each followed by optim_step, in-process (an `Engine` in this process) and through the stack.

    .venv/bin/python benchmarks/grpo_step.py [--prompts 8 --samples 4 --tokens 64 --threads 2 --rounds 3]
    .venv/bin/python benchmarks/grpo_step.py --calls [--model_dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from treadle.recipes.lib.advantages import group_advantages
from treadle.recipes.lib.datums import rl_datum
from treadle.recipes.lib.evaluation import prompt_messages
from treadle.recipes.lib.math_tasks import arithmetic_problem_at, reward
from treadle.recipes.lib.rendering import render_generation_prompt

LEARNING_RATE = 3e-4
MODES = ("treadle", "treadle_batched", "hand", "trl")
PARTS = ("sampling", "training", "snapshot", "client")


def problems_and_prompts(tokenizer, count: int, offset: int):
    problems = [arithmetic_problem_at(0, offset + i, 9) for i in range(count)]
    return problems, [render_generation_prompt(tokenizer, prompt_messages(p.question, None)) for p in problems]


def group_datums(tokenizer, problem, prompt, group):
    """One group's datums: rewards centred on the group mean; uniform groups still train (A = 0)."""
    rewards = [reward(tokenizer.decode(t, skip_special_tokens=True), problem.answer, 0.0, True) for t, _ in group]
    return [rl_datum(prompt, t, lp, a) for (t, lp), a in zip(group, group_advantages(rewards, False)) if t]


class Clock:
    """Seconds spent per part of a step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.split = dict.fromkeys(PARTS, 0.0)
        self.mark = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.split[part] += now - self.mark
        self.mark = now


def treadle_step(training, sampler, tokenizer, problems, prompts, args, *, per_group: bool):
    """The step on the SDK (math_rl's shape when `per_group`); returns the new sampler and the split."""
    from treadle import AdamParams, ModelInput, SamplingParams

    clock = Clock()
    futures = [
        sampler.sample(
            ModelInput.from_ints(p), args.samples, SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    fwd, held = [], []
    clock.lap("client")
    for problem, prompt, future in zip(problems, prompts, futures):
        sequences = future.result().sequences
        clock.lap("sampling")
        datums = group_datums(tokenizer, problem, prompt, [(s.tokens, s.logprobs) for s in sequences])
        if per_group:
            fwd.append(training.forward_backward(datums, "importance_sampling"))
        held += datums
        clock.lap("client")
    if not per_group:
        fwd.append(training.forward_backward(held, "importance_sampling"))
    optim = training.optim_step(AdamParams(learning_rate=LEARNING_RATE, eps=1e-8))
    clock.lap("client")
    for future in [*fwd, optim]:
        future.result()
    clock.lap("training")
    sampler = training.save_weights_and_get_sampling_client()
    clock.lap("snapshot")
    return sampler, clock.split


# ---------------------------------------------------------------- baselines, each in a process of its own


def hand_loop(args, proto, commands) -> None:
    """The hand-written step: batched generate, one forward/backward, AdamW on the PEFT adapter."""
    sys.path.insert(0, os.path.dirname(__file__))
    from sampling import InProcess

    from treadle.gpu_worker.training.logprobs import target_logprobs
    from treadle.gpu_worker.training.losses import importance_sampling

    loop = InProcess(args.model_dir, args.rank)
    torch = loop.torch
    params = list(loop.bank.parameters("policy").values())
    adamw = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    tokenizer = loop.host.tokenizer
    for line in commands:
        problems, prompts = problems_and_prompts(tokenizer, args.prompts, int(line) * args.prompts)
        clock = Clock()
        completions = loop.generate(prompts, args.samples, args.tokens)
        clock.lap("sampling")
        datums = []
        for g, (problem, prompt) in enumerate(zip(problems, prompts)):
            datums += group_datums(tokenizer, problem, prompt, completions[g * args.samples : (g + 1) * args.samples])
        clock.lap("client")
        with loop.bank.using("policy", trainable=True) as model:
            lps = target_logprobs(
                model,
                [np.asarray(d.model_input.to_ints(), dtype=np.int64) for d in datums],
                [d.loss_fn_inputs["target_tokens"].to_numpy() for d in datums],
                device=loop.host.device,
                pad_token_id=loop.host.pad_token_id,
            )
            inputs = {
                k: torch.from_numpy(np.concatenate([d.loss_fn_inputs[k].to_numpy() for d in datums]).astype(np.float32))
                for k in ("logprobs", "advantages")
            }
            importance_sampling(torch.cat(lps), inputs, {}).backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        clock.lap("training")
        proto.write(json.dumps(clock.split) + "\n")
        release_memory()


def trl_loop(args, proto, commands) -> None:
    """TRL's GRPOTrainer on the same problems; a callback waits for each round's command and reports its split."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    problems = [arithmetic_problem_at(0, i, 9) for i in range((args.rounds + 1) * args.prompts)]
    dataset = datasets.Dataset.from_list(
        [{"prompt": prompt_messages(p.question, None), "answer": p.answer} for p in problems]
    )

    def rewards(completions, answer, **_):
        return [reward(c[0]["content"], a, 0.0, True) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-trl-"),
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        max_completion_length=args.tokens,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        beta=0.0,
        max_steps=args.rounds + 1,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's default recomputes the forward; the other loops do not
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    lora = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    clock = Clock()
    for name, part in (("_generate", "sampling"), ("_generate_and_score_completions", "client")):
        trainer.__dict__[name] = _timed(getattr(trainer, name), clock, part)

    class Rounds(TrainerCallback):
        def on_step_begin(self, *_, **__):
            next(commands)
            clock.reset()

        def on_step_end(self, *_, **__):
            clock.lap("training")
            proto.write(json.dumps(clock.split) + "\n")
            release_memory()

    trainer.add_callback(Rounds())
    torch.set_num_threads(args.threads)
    trainer.train()


def _timed(fn, clock: Clock, part: str):
    """`fn`, with the time up to its start charged to training and its own to `part` (sampling nests in client)."""

    def run(*a, **kw):
        clock.lap("training" if part == "client" else "client")
        out = fn(*a, **kw)
        clock.lap(part)
        return out

    return run


def release_memory() -> None:
    """Hand the memory glibc keeps after a step back to the system (Linux, glibc)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def child(args) -> None:
    """A baseline's process: reads a round number per line, answers each with its split as one JSON line."""
    import torch

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries' prints go to stderr; stdout carries only the answers
    torch.set_num_threads(args.threads)
    (hand_loop if args.child == "hand" else trl_loop)(args, proto, iter(sys.stdin.readline, ""))


class Child:
    def __init__(self, mode: str, argv: list[str]):
        command = [sys.executable, __file__, *argv, "--child", mode]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def step(self, round_index: int) -> dict[str, float]:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(f"{round_index}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"baseline process {self.process.args} ended (exit {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


# ---------------------------------------------------------------- the training half alone


def fixed_groups(tokenizer, args, vocab: int):
    """`--prompts` groups of `--samples` datums with fixed random completions (the same every round)."""
    rng = np.random.default_rng(0)
    problems, prompts = problems_and_prompts(tokenizer, args.prompts, 0)
    groups = []
    for prompt in prompts:
        lengths = rng.integers(max(1, args.tokens // 3), args.tokens + 1, args.samples)
        groups.append(
            [
                rl_datum(prompt, rng.integers(0, vocab, n).tolist(), (-rng.random(n)).tolist(), rng.normal())
                for n in lengths
            ]
        )
    return groups


def training_calls(args, stack) -> None:
    """Per-group forward_backward calls against one call over the same rows, in-process and through the stack."""
    import torch

    from treadle import AdamParams, ServiceClient
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig

    torch.set_num_threads(args.threads)
    engine = Engine(args.model_dir)
    engine.create_session("calls", LoraConfig(rank=args.rank, alpha=args.rank, seed=0))
    training = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url).create_lora_training_client(
        "bench", rank=args.rank, alpha=args.rank, seed=0
    )
    groups = fixed_groups(engine.tokenizer, args, min(engine.vocab_size, 10_000))
    adam = AdamParams(learning_rate=LEARNING_RATE, eps=1e-8)

    def in_process(calls):
        for datums in calls:
            engine.forward_backward("calls", datums, "importance_sampling")
        engine.optim_step("calls", adam)

    def through_stack(calls):
        futures = [training.forward_backward(datums, "importance_sampling") for datums in calls]
        futures.append(training.optim_step(adam))
        for future in futures:
            future.result()

    shapes = {"per-group": groups, "one call": [[d for g in groups for d in g]]}
    times: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds + 1):
        for where, run in (("in-process", in_process), ("stack", through_stack)):
            for shape, calls in shapes.items():
                started = time.perf_counter()
                run(calls)
                elapsed = time.perf_counter() - started
                print(f"round {round_index} {where:<10} {shape:<9} {elapsed:.2f} s", flush=True)
                if round_index:
                    times.setdefault((where, shape), []).append(elapsed)
    training.stop()
    engine.close()
    print(
        f"\n{len(groups)} groups x {args.samples} rows, {args.threads} torch threads, {args.rounds} rounds (median s)"
    )
    for where in ("in-process", "stack"):
        per, one = times[(where, "per-group")], times[(where, "one call")]
        ratio = statistics.median(p / o for p, o in zip(per, one))
        print(
            f"  {where:<10} per-group {statistics.median(per):.2f}, one call {statistics.median(one):.2f}: {ratio:.2f}x"
        )


# ---------------------------------------------------------------- the run


def report(args, splits: dict[str, list[dict[str, float]]]) -> None:
    print(
        f"\nGRPO step, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, importance_sampling, "
        f"LoRA r{args.rank}, {args.threads} torch threads, {args.rounds} rounds (median s)"
    )
    print(f"  {'mode':<16}{'step':>8}" + "".join(f"{p:>10}" for p in PARTS))
    for mode, rounds in splits.items():
        med = {p: statistics.median(r[p] for r in rounds) for p in PARTS}
        total = statistics.median(sum(r.values()) for r in rounds)
        print(f"  {mode:<16}{total:>8.1f}" + "".join(f"{med[p]:>10.1f}" for p in PARTS))
    for mode in [m for m in splits if m.startswith("treadle")]:
        for base in [m for m in ("hand", "trl") if m in splits]:
            ratio = statistics.median(sum(t.values()) / sum(b.values()) for t, b in zip(splits[mode], splits[base]))
            print(f"{mode} / {base}: {ratio:.2f}x step", end="")
            if base == "hand" and mode == "treadle_batched":
                sampling = statistics.median(t["sampling"] / b["sampling"] for t, b in zip(splits[mode], splits[base]))
                print(f", sampling {sampling:.2f}x one batched generate", end="")
            print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="problems (groups) per step")
    parser.add_argument("--samples", type=int, default=4, help="completions per problem")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per completion")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in each baseline and in the worker")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up step of each)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--model_dir", default=None, help="model directory (default: SmolLM2-135M-Instruct, prepared offline)"
    )
    parser.add_argument("--calls", action="store_true", help="measure per-group forward_backward calls alone")
    parser.add_argument("--child", choices=("hand", "trl"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from transformers import AutoTokenizer

    from treadle import ServiceClient
    from treadle.demo.model import prepare_smollm2
    from treadle.local_stack import LocalStack

    args.model_dir = args.model_dir or prepare_smollm2()
    if args.calls:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        with tempfile.TemporaryDirectory() as tmp, LocalStack([f"bench={args.model_dir}"], home=f"{tmp}/s") as stack:
            return training_calls(args, stack)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; expected some of {', '.join(MODES)}")
    if "trl" in modes and importlib.util.find_spec("trl") is None:
        raise SystemExit("--modes includes trl, but TRL is not installed: pip install -e '.[bench]' (or drop trl)")
    argv = [f"--{k}={getattr(args, k)}" for k in ("prompts", "samples", "tokens", "rank", "threads", "rounds")]
    children = {m: Child(m, [*argv, f"--model_dir={args.model_dir}"]) for m in modes if m in ("hand", "trl")}
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the worker process at start
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    splits: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp, LocalStack([f"bench={args.model_dir}"], home=f"{tmp}/stack") as stack:
        service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        clients = {}
        for mode in [m for m in modes if m.startswith("treadle")]:
            training = service.create_lora_training_client("bench", rank=args.rank, alpha=args.rank, seed=0)
            clients[mode] = (training, training.save_weights_and_get_sampling_client())
        for round_index in range(args.rounds + 1):  # round 0 is the warm-up
            problems, prompts = problems_and_prompts(tokenizer, args.prompts, round_index * args.prompts)
            for mode in modes[round_index % len(modes) :] + modes[: round_index % len(modes)]:
                if mode in children:
                    split = children[mode].step(round_index)
                else:
                    training, sampler = clients[mode]
                    sampler, split = treadle_step(
                        training, sampler, tokenizer, problems, prompts, args, per_group=mode == "treadle"
                    )
                    clients[mode] = (training, sampler)
                print(f"round {round_index} {mode:<16} " + ", ".join(f"{p} {split[p]:.1f}" for p in PARTS), flush=True)
                if round_index:
                    splits[mode].append(split)
        for training, _ in clients.values():
            training.stop()
    for c in children.values():
        c.close()
    report(args, splits)


if __name__ == "__main__":
    main()
