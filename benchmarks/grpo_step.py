"""One GRPO step through treadle against the same step written in-process, side by side in one run.

The step: sample `--samples` completions of each of `--prompts` arithmetic problems (T=1, up to
`--tokens` tokens), reward right answers, centre the rewards per group, train one
`importance_sampling` forward_backward over every completion, one AdamW step, and a new sampler
snapshot. Through treadle, the loop is the SDK's (requests submitted at once as futures, as the
README's GRPO loop does); in-process, it is one batched HF `generate` on a PEFT model, one padded
forward/backward with the same loss, and `torch.optim.AdamW`. Rounds alternate the two, a warm-up
step of each is left out, and the ratio is the median of the per-round ratios.

    .venv/bin/python benchmarks/grpo_step.py [--prompts 8 --samples 4 --tokens 64 --threads 2 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from sampling import InProcess

from treadle.recipes.advantages import group_advantages
from treadle.recipes.datums import rl_datum
from treadle.recipes.evaluation import prompt_messages
from treadle.recipes.math_tasks import arithmetic_problem_at, reward
from treadle.recipes.rendering import render_generation_prompt

LEARNING_RATE = 3e-4


def problems_and_prompts(tokenizer, count: int, offset: int):
    problems = [arithmetic_problem_at(0, offset + i, 9) for i in range(count)]
    return problems, [render_generation_prompt(tokenizer, prompt_messages(p.question, None)) for p in problems]


def datums_of(tokenizer, problems, prompts, completions, samples: int):
    """GRPO datums: per group, rewards centred on the group mean; uniform groups still train (A = 0)."""
    datums = []
    for g, (problem, prompt) in enumerate(zip(problems, prompts)):
        group = completions[g * samples : (g + 1) * samples]
        rewards = [reward(tokenizer.decode(t, skip_special_tokens=True), problem.answer, 0.0, True) for t, _ in group]
        datums += [rl_datum(prompt, t, lp, a) for (t, lp), a in zip(group, group_advantages(rewards, False)) if t]
    return datums


class InProcessStep(InProcess):
    """The baseline step: batched generate, then one forward/backward and AdamW on the PEFT adapter."""

    def __init__(self, model_dir: str, rank: int):
        super().__init__(model_dir, rank)
        from treadle.gpu_worker.training.logprobs import target_logprobs
        from treadle.gpu_worker.training.losses import importance_sampling

        self.target_logprobs, self.loss = target_logprobs, importance_sampling
        params = list(self.bank.parameters("policy").values())
        self.adamw = self.torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step(self, problems, prompts, samples: int, tokens: int) -> None:
        torch = self.torch
        datums = datums_of(self.host.tokenizer, problems, prompts, self.generate(prompts, samples, tokens), samples)
        with self.bank.using("policy", trainable=True) as model:
            lps = self.target_logprobs(
                model,
                [np.asarray(d.model_input.to_ints(), dtype=np.int64) for d in datums],
                [d.loss_fn_inputs["target_tokens"].to_numpy() for d in datums],
                device=self.host.device,
                pad_token_id=self.host.pad_token_id,
            )
            inputs = {
                k: torch.from_numpy(np.concatenate([d.loss_fn_inputs[k].to_numpy() for d in datums]).astype(np.float32))
                for k in ("logprobs", "advantages")
            }
            self.loss(torch.cat(lps), inputs, {}).backward()
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)


def treadle_step(training, sampler, tokenizer, problems, prompts, samples: int, tokens: int):
    """The same step on the SDK; returns the new sampler."""
    from treadle import AdamParams, ModelInput, SamplingParams

    futures = [
        sampler.sample(ModelInput.from_ints(p), samples, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]
    completions = [(s.tokens, s.logprobs) for f in futures for s in f.result().sequences]
    fwd = training.forward_backward(
        datums_of(tokenizer, problems, prompts, completions, samples), "importance_sampling"
    )
    optim = training.optim_step(AdamParams(learning_rate=LEARNING_RATE, eps=1e-8))
    fwd.result(), optim.result()
    return training.save_weights_and_get_sampling_client()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="problems (groups) per step")
    parser.add_argument("--samples", type=int, default=4, help="completions per problem")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per completion")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in-process and in the worker")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up step of each)")
    parser.add_argument(
        "--model_dir", default=None, help="model directory (default: SmolLM2-135M-Instruct, prepared offline)"
    )
    args = parser.parse_args()

    from treadle import ServiceClient
    from treadle.demo.model import prepare_smollm2
    from treadle.local_stack import LocalStack

    model_dir = args.model_dir or prepare_smollm2()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the worker process at start
    inproc = InProcessStep(model_dir, args.rank)
    inproc.torch.set_num_threads(args.threads)
    tokenizer = inproc.host.tokenizer
    times: dict[str, list[float]] = {"in-process": [], "treadle": []}
    with tempfile.TemporaryDirectory() as tmp, LocalStack([f"bench={model_dir}"], home=f"{tmp}/stack") as stack:
        service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        training = service.create_lora_training_client("bench", rank=args.rank, alpha=args.rank, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        for round_index in range(args.rounds + 1):  # round 0 is the warm-up
            problems, prompts = problems_and_prompts(tokenizer, args.prompts, round_index * args.prompts)
            started = time.perf_counter()
            inproc.step(problems, prompts, args.samples, args.tokens)
            in_process = time.perf_counter() - started
            started = time.perf_counter()
            sampler = treadle_step(training, sampler, tokenizer, problems, prompts, args.samples, args.tokens)
            through = time.perf_counter() - started
            if round_index:
                times["in-process"].append(in_process)
                times["treadle"].append(through)
                print(f"round {round_index}: in-process {in_process:.1f} s, treadle {through:.1f} s", flush=True)
        training.stop()

    print(
        f"\nGRPO step, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, importance_sampling, "
        f"LoRA r{args.rank}, {args.threads} torch threads, {args.rounds} rounds (median)"
    )
    for name, values in times.items():
        print(f"  {name:<11} {statistics.median(values):7.1f} s")
    ratio = statistics.median(t / i for t, i in zip(times["treadle"], times["in-process"]))
    print(f"treadle / in-process: {ratio:.2f}x  (target <= 1.15)")


if __name__ == "__main__":
    main()
