"""Sampling throughput of treadle against the in-process limit, side by side in one run.

Rows of one round, all on the same model, LoRA adapter shape and torch thread count:

1. in-process: one batched HF `generate` of every row (prompts x samples, left-padded) on a PEFT
   LoRA model: the limit the hardware gives;
2. treadle, the requests submitted at once as futures (what a GRPO loop does);
3. treadle, one request at a time;
4. `--sessions` sessions sampling at once, and the same sessions one after another; against the
   ceiling measured in the same run, in-process after the rounds: the sessions' rows decoded as one
   batch per session, one step each, against one step of all their rows (base model, the sampler's
   own decode step): what batching the sessions can gain at most on this CPU;
5. the sampler backends side by side (`--backends hf,vllm`), each in an engine of its own in this
   process, the same requests at once, on the base model and on a LoRA snapshot (vLLM needs
   .venv-vllm: scripts/setup_vllm.sh). `--backends_only` skips rows 1-4.

Rounds alternate the rows, so the machine's drift (other users of the CPU) hits all of them alike;
the ratios are medians over rounds of the per-round ratios. A warm-up round is left out. Tokens are
the tokens returned: a row ends at EOS (in-process rows are cut at their first EOS too).

    .venv/bin/python benchmarks/sampling.py [--prompts 8 --samples 8 --tokens 64 --threads 2 --rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how rain forms, in detail.",
    "Describe a journey across a desert.",
    "Write a letter to a friend about your garden.",
    "Tell the history of bread.",
    "Describe the life of a honeybee.",
    "Write a story about a robot who paints.",
    "Explain how a bicycle works.",
    "Describe a busy market in the morning.",
    "Write about the sea at night.",
    "Tell a story about two brothers and a river.",
    "Explain why the sky changes colour at sunset.",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for i in range(count)
    ]


class InProcess:
    """The baseline: the model with one PEFT LoRA adapter, in this process, sampled with `generate`."""

    def __init__(self, model_dir: str, rank: int):
        import torch
        from transformers import GenerationConfig

        from treadle.gpu_worker.model.adapters import AdapterBank
        from treadle.gpu_worker.model.host import ModelHost
        from treadle.types import LoraConfig

        self.torch = torch
        self.host = ModelHost(model_dir)
        self.bank = AdapterBank(self.host)
        self.bank.add("policy", self.bank.lora_config(LoraConfig(rank=rank, alpha=rank)), seed=0)
        self.config = lambda tokens: GenerationConfig(
            do_sample=True,
            max_new_tokens=tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.host.pad_token_id,
            eos_token_id=self.host.eos_token_id,
        )

    def generate(self, prompts: list[list[int]], samples: int, tokens: int) -> list[tuple[list[int], list[float]]]:
        """One batched `generate` of every row: per row, its tokens through the first EOS and their logprobs."""
        torch, pad, eos = self.torch, self.host.pad_token_id, self.host.eos_token_id
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(samples)]
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        device = self.host.device
        with self.bank.using("policy", trainable=False) as model, torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=self.config(tokens),
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[:, width:]
        logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in out.logits], dim=1)
        logprobs = logprobs.gather(2, new.unsqueeze(2)).squeeze(2)
        result = []
        for row, lp in zip(new.tolist(), logprobs.tolist()):
            end = row.index(eos) + 1 if eos in row else len(row)
            result.append((row[:end], lp[:end]))
        return result


def sample_all(samplers_and_prompts, samples: int, tokens: int, *, at_once: bool) -> int:
    """Tokens returned for every (sampler, prompt): all submitted before any is awaited, or one by one."""
    from treadle import ModelInput, SamplingParams

    def submit(i, sampler, prompt):
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)
        return sampler.sample(ModelInput.from_ints(prompt), num_samples=samples, sampling_params=params)

    if at_once:
        futures = [submit(i, s, p) for i, (s, p) in enumerate(samplers_and_prompts)]
        results = [f.result() for f in futures]
    else:
        results = [submit(i, s, p).result() for i, (s, p) in enumerate(samplers_and_prompts)]
    return sum(len(seq.tokens) for r in results for seq in r.sequences)


def backend_rows(model_dir: str, prompts: list[list[int]], args) -> dict[str, list[tuple[int, float]]]:
    """Per backend, base model and LoRA snapshot: (tokens, seconds) of every prompt's request at once."""
    from treadle.gpu_worker.engine import Engine
    from treadle.types import LoraConfig, ModelInput, SamplingParams

    results: dict[str, list[tuple[int, float]]] = {}
    for kind in args.backends.split(","):
        engine = Engine(model_dir, sampler=kind)
        engine.create_session("bench", LoraConfig(rank=args.rank, alpha=args.rank, seed=0))
        engine.snapshot_sampler("bench", "snapshot")

        def at_once(sampler, samples, tokens, engine=engine):
            futures = [
                engine.samplers.sample_async(
                    sampler, ModelInput.from_ints(p), samples, SamplingParams(max_tokens=tokens, seed=i)
                )
                for i, p in enumerate(prompts[: args.prompts])
            ]
            return sum(len(s.tokens) for f in futures for s in f.result().sequences)

        for label, sampler in (("base", None), (f"LoRA r{args.rank}", "snapshot")):
            at_once(sampler, 2, 8)  # warm-up
            results[f"{kind}, {label}"] = [
                timed(lambda: at_once(sampler, args.samples, args.tokens)) for _ in range(args.rounds)
            ]
        engine.close()
    return results


def decode_ceiling(inproc, sessions_prompts: list[list[list[int]]], samples: int, steps: int = 8) -> float:
    """Each session's rows decoded alone, one step each, summed, over one step of all of them (base model)."""
    from decode_step import treadle_steps  # this directory's benchmarks/decode_step.py

    def step(prompts: list[list[int]]) -> float:
        return statistics.median(treadle_steps(inproc.bank, prompts, [None] * len(prompts), samples, steps))

    everyone = [p for prompts in sessions_prompts for p in prompts]
    return statistics.median(sum(step(prompts) for prompts in sessions_prompts) / step(everyone) for _ in range(2))


def timed(fn) -> tuple[int, float]:
    started = time.perf_counter()
    count = fn()
    return count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="requests (prompts) per measurement")
    parser.add_argument("--samples", type=int, default=8, help="num_samples per request")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per row")
    parser.add_argument("--sessions", type=int, default=4, help="sessions of the multi-session rows")
    parser.add_argument("--session_prompts", type=int, default=1, help="requests per session in the multi-session rows")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank of every adapter")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in-process and in the worker")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up round)")
    parser.add_argument(
        "--model_dir", default=None, help="model directory (default: SmolLM2-135M-Instruct, prepared offline)"
    )
    parser.add_argument("--worker_args", default="", help="extra `treadle worker` options, space-separated")
    parser.add_argument("--backends", default="hf,vllm", help="sampler backends compared in rows 5, comma-separated")
    parser.add_argument("--backends_only", action="store_true", help="only the backend rows (5)")
    args = parser.parse_args()

    from treadle import ServiceClient
    from treadle.demo.model import prepare_smollm2
    from treadle.local_stack import LocalStack

    model_dir = args.model_dir or prepare_smollm2()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the worker process at start
    inproc = InProcess(model_dir, args.rank)
    inproc.torch.set_num_threads(args.threads)
    prompts = chat_prompts(inproc.host.tokenizer, max(args.prompts, args.sessions * args.session_prompts))
    if args.backends_only:
        print_backends(backend_rows(model_dir, prompts, args), args)
        return
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalStack([f"bench={model_dir}"], home=f"{tmp}/stack", worker_args=args.worker_args.split()) as stack,
    ):
        service = ServiceClient(broker_url=stack.broker_url, storage_url=stack.storage_url)
        trainers = [
            service.create_lora_training_client("bench", rank=args.rank, alpha=args.rank, seed=i)
            for i in range(args.sessions)
        ]
        samplers = [t.save_weights_and_get_sampling_client() for t in trainers]
        one = [(samplers[0], p) for p in prompts[: args.prompts]]
        per_session = [
            [(s, prompts[k * args.session_prompts + j]) for j in range(args.session_prompts)]
            for k, s in enumerate(samplers)
        ]
        rows = {
            "in-process batched generate": lambda n, t: sum(
                len(r) for r, _ in inproc.generate(prompts[: args.prompts], n, t)
            ),
            "treadle, requests at once": lambda n, t: sample_all(one, n, t, at_once=True),
            "treadle, one request at a time": lambda n, t: sample_all(one, n, t, at_once=False),
            f"{args.sessions} sessions at once": lambda n, t: sample_all(
                [x for s in per_session for x in s], n, t, at_once=True
            ),
            f"{args.sessions} sessions one after another": lambda n, t: sum(
                sample_all(s, n, t, at_once=True) for s in per_session
            ),
        }
        for fn in rows.values():  # warm-up, left out of the figures
            fn(2, 8)
        results: dict[str, list[tuple[int, float]]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, fn in rows.items():
                results[name].append(timed(lambda: fn(args.samples, args.tokens)))
        for t in trainers:
            t.stop()

    rate = {name: [n / s for n, s in runs] for name, runs in results.items()}
    names = list(rows)
    print(
        f"\nsampling throughput, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, T=1, "
        f"LoRA r{args.rank}, {args.threads} torch threads, {args.rounds} rounds (median)"
    )
    print(f"{'row':<34}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    for name in names:
        print(
            f"{name:<34}{statistics.median(n for n, _ in results[name]):>8.0f}"
            f"{statistics.median(s for _, s in results[name]):>9.1f}{statistics.median(rate[name]):>10.1f}"
        )

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rate[a], rate[b]))

    print(f"\ntreadle at once / in-process generate: {ratio(names[1], names[0]):.2f}x  (target >= 0.9)")
    print(f"treadle at once / one at a time:       {ratio(names[1], names[2]):.2f}x  (target >= 2)")
    sessions = ratio(names[3], names[4])
    ceiling = decode_ceiling(inproc, [[p for _, p in s] for s in per_session], args.samples)
    print(f"{args.sessions} sessions at once / one after another: {sessions:.2f}x  (target >= 2.5 on the tiny model)")
    print(
        f"  the ceiling, their decode steps apart / together: {ceiling:.2f}x; reached: {sessions / ceiling:.2f} (target >= 0.8)"
    )
    if args.backends:
        print_backends(backend_rows(model_dir, prompts, args), args)


def print_backends(results: dict[str, list[tuple[int, float]]], args) -> None:
    print(
        f"\nsampler backends, engine level, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, "
        f"T=1, {args.threads} torch threads, {args.rounds} rounds (median)"
    )
    print(f"{'backend':<34}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    for name, runs in results.items():
        print(
            f"{name:<34}{statistics.median(n for n, _ in runs):>8.0f}{statistics.median(s for _, s in runs):>9.1f}"
            f"{statistics.median(n / s for n, s in runs):>10.1f}"
        )


if __name__ == "__main__":
    main()
