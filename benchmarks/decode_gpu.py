"""The HF sampler's decode paths on one CUDA device, against the memory roofline and HF's own compiled `generate`.

scripts/gpu_check.sh's `decode` part runs it on SmolLM2-1.7B's shapes (random bf16 weights). The work: `--prompts`
prompts of about `--prompt_length` tokens x `--samples` samples (64 rows), `--tokens` tokens a row at T=1 with no
stop token (every row runs its whole length), driven in-process below the scheduler, as tests/test_static_decode.py
drives it. It measures:

1. the static-shape path (`SlotBatch`: each decode step one `torch.compile(mode="reduce-overhead")` call, replayed
   as a CUDA graph): tokens/s of a round (prefill included) and of its decode steps, on the base model and on
   `--prompts` LoRA snapshots mixed (rank `--rank`, one prompt each, trained one step so that B != 0); median of
   `--rounds` rounds after a warm-up round each (the compile and the capture: its time is printed too);
2. the dynamic path (`DecodeBatch`) on the same rows: `--dynamic_steps` steps only (on a GPU it is bound by
   launching its thousands of kernels a step), milliseconds a step;
3. HF `generate` on the base weights with a static cache, which on CUDA compiles the decode forward (transformers'
   `CompileConfig`: reduce-overhead, fullgraph, static shapes), the same rows left-padded, `min_new_tokens` =
   `max_new_tokens`, after a warm-up call;
4. torch.profiler over one more round's decode steps of the static path and over half as many steps of the dynamic
   one: the GPU's busy share (its kernels' and copies' time over the wall time, the profiler's own overhead in
   the wall time), kernels and CUDA graph launches per step;
5. the memory roofline of a decode step: the bytes it must read (the weights, K and V of every row at the round's
   mean length) over the bandwidth of a device-to-device copy measured here; the static decode steps' tokens/s as a
   share of the roofline's;
6. |sampled - trainer| logprob of every token of a LoRA round (the trainer's forward on the sessions the snapshots
   were taken from);
7. after the table above, in a table of its own, the deterministic mode (`--sampler_deterministic_rows`: one fixed
   bucket, `SlotBatch(fixed=...)`) on the LoRA rounds: its tokens/s against the default's, and a probe row (prompt 0
   on its snapshot, one sample, seed 1000) alone and admitted last beside the other prompts' rows, with and without
   the mode: max abs logprob difference over the tokens both drew alike (the mode's target: 0, bitwise). Its compiles
   (the fixed bucket; the default path's 8-row bucket, for the probe alone) are printed as warm-up times.

It prints one table with the GPU targets beside the figures (PASS/FAIL): the static decode steps (base) at least
30 % of the roofline's tokens/s, a static round (base) at least 1.0x HF generate's tokens/s, the GPU busy at least
70 % of a profiled static round (base), a mean logprob gap of at most 0.01 nats, the deterministic mode's probe
bitwise alike. It exits 1 when one fails or a part raises (the other parts' figures are still printed). The warm-up
rounds' times say what the compiles cost; a rerun on the same machine reuses Inductor's caches on disk, and
`--skip hf,dynamic,profile,deterministic` leaves parts out.

    python benchmarks/decode_gpu.py --model DIR [--prompts 8 --samples 8 --tokens 128 --prompt_length 64]

`--device cpu` is a smoke run of this script on a small model: the static path runs eagerly (no CUDA graphs), HF
`generate` without compile, the profiler counts CPU operators (no kernels, no busy share), no target is judged.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch._dynamo.utils import counters
from torch.profiler import DeviceType, ProfilerActivity, profile

from gpu_check import synchronize  # this folder's gpu_check.py (a script's folder is on its path)
from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.model_check import cross_entropy_datum
from treadle.gpu_worker.sampling.backend import SampleJob
from treadle.gpu_worker.sampling.hf.batch_decode import DecodeBatch
from treadle.gpu_worker.sampling.hf.slot_batch import FIXED_RANK, SlotBatch, fixed_bucket
from treadle.gpu_worker.training.validation import prepare_sample
from treadle.types import AdamParams, LoraConfig, ModelInput, SamplingParams

# The GPU targets: the static path's decode steps against the roofline, a round against HF's compiled `generate`,
# the GPU's busy share of a profiled round, and the mean logprob gap (nats).
ROOFLINE_SHARE, HF_RATIO, BUSY_SHARE, MEAN_GAP = 0.30, 1.0, 0.70, 0.01


@dataclass
class Round:
    seconds: float  # admission (prefill) and every decode step
    decode_seconds: float
    steps: int
    tokens: int
    jobs: list[SampleJob]
    capacity: int  # the bucket's positions a row

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def decode_rate(self, rows: int) -> float:
        return (self.tokens - rows) / self.decode_seconds  # each row's first token comes from the prefill


@dataclass
class Profile:
    wall: float
    busy: float  # seconds of device activity (kernels, copies, sets); 0 on a CPU
    kernels: int  # on a CPU: top-level aten operators
    graph_launches: int
    steps: int


class Bench:
    """The engine, its sessions and snapshots, and the rows every path decodes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        self.engine = Engine(args.model, device=args.device, dtype="bfloat16", sampler="hf")
        self.host = self.engine._host
        # Counted before any session: peft's LoRA layers are not the base model's weights.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.host.model.parameters())
        rng = np.random.default_rng(0)
        top = min(self.host.vocab_size, 20000)
        first = args.prompt_length - args.prompts // 2
        self.prompts = [rng.integers(5, top, size=first + i).tolist() for i in range(args.prompts)]
        self.rows = args.prompts * args.samples
        self.sessions = [f"s{i}" for i in range(args.prompts)]
        for i, session in enumerate(self.sessions):
            self.engine.create_session(session, LoraConfig(rank=args.rank, alpha=args.rank, seed=i))
            data = [cross_entropy_datum(rng.integers(5, top, size=64).tolist()) for _ in range(2)]
            self.engine.forward_backward(session, data, "cross_entropy")
            self.engine.optim_step(session, AdamParams(learning_rate=1e-3))  # B != 0: the deltas count
            self.engine.snapshot_sampler(session, f"snap{i}")
        self.adapters = [self.engine.samplers.adapter(f"snap{i}") for i in range(args.prompts)]

    def jobs(self, lora: bool) -> list[SampleJob]:
        return [self.job(i, self.args.samples, i, lora) for i in range(len(self.prompts))]

    def job(self, prompt: int, samples: int, seed: int, lora: bool) -> SampleJob:
        params = SamplingParams(max_tokens=self.args.tokens, temperature=1.0, seed=seed)
        request = prepare_sample(
            ModelInput.from_ints(self.prompts[prompt]),
            samples,
            params,
            0,
            max_seq_len=self.host.max_seq_len,
            vocab_size=self.host.vocab_size,
        )
        adapter = self.adapters[prompt] if lora else None
        return SampleJob(adapter, request, samples, params, frozenset())  # no stop: full rows

    def probe(self, batch: SlotBatch, beside: bool) -> tuple[list[int], list[float]]:
        """Prompt 0 on its snapshot, one sample, seed 1000: alone, or admitted last beside the other prompts' rows
        (so in another slot and another prefill); its tokens and logprobs."""
        probe = self.job(0, 1, 1000, True)
        with self.engine.device, torch.no_grad():
            batch.admit([*(self.jobs(True)[1:] if beside else []), probe])
            until_empty(batch)
        drawn = probe.sequences[0]
        assert drawn is not None and drawn.logprobs is not None
        return drawn.tokens, drawn.logprobs

    def round(self, batch: SlotBatch, lora: bool, profiled: bool = False) -> tuple[Round, Profile | None]:
        """One round of every row on `batch`, to its end; with `profiled`, its decode steps under torch.profiler."""
        jobs = self.jobs(lora)
        with self.engine.device, torch.no_grad():
            synchronize()
            started = time.perf_counter()
            batch.admit(jobs)
            synchronize()
            admitted = time.perf_counter()
            capacity = batch._cache.capacity if batch._cache is not None else 0
            run = lambda: until_empty(batch)  # noqa: E731
            prof = profiled_steps(run, self.cuda) if profiled else None
            steps = prof.steps if prof else run()
            synchronize()
            ended = time.perf_counter()
        tokens = [len(s.tokens) for job in jobs for s in job.sequences if s is not None]
        if tokens != [self.args.tokens] * self.rows:  # a figure of shorter rows would not be this work's
            raise SystemExit(f"decode_gpu: rows ended early: {sorted(set(tokens))} tokens, not {self.args.tokens}")
        return Round(ended - started, ended - admitted, steps, sum(tokens), jobs, capacity), prof

    def dynamic(self, lora: bool) -> tuple[list[float], Profile | None]:
        """Seconds of each of `--dynamic_steps` steps of the dynamic path (after one untimed step), and a profile
        of half as many steps more."""
        batch = DecodeBatch(self.engine._bank, self.host)
        with self.engine.device, torch.no_grad():
            batch.admit(self.jobs(lora))
            batch.step()
            times = []
            for _ in range(self.args.dynamic_steps):
                synchronize()
                started = time.perf_counter()
                batch.step()
                synchronize()
                times.append(time.perf_counter() - started)
            profiled = max(1, len(times) // 2)

            def more() -> int:
                for _ in range(profiled):
                    batch.step()
                return profiled

            prof = profiled_steps(more, self.cuda) if "profile" not in self.args.skip else None
            batch.fail_all()
        return times, prof

    def logprob_gaps(self, jobs: list[SampleJob]) -> np.ndarray:
        """|sampled - trainer forward| logprob of every sampled token of a LoRA round's jobs."""
        gaps = []
        for job, session in zip(jobs, self.sessions):
            prompt = job.request.prompt.tolist()
            sequences = [s for s in job.sequences if s is not None]
            out = self.engine.forward(
                session, [cross_entropy_datum(prompt + s.tokens) for s in sequences], "cross_entropy"
            )
            for seq, output in zip(sequences, out.loss_fn_outputs):
                expected = output["logprobs"].to_numpy()[len(prompt) - 1 :]
                gaps.append(np.abs(np.asarray(seq.logprobs) - expected))
        return np.concatenate(gaps)

    def kv_bytes_per_position(self) -> int:
        """K and V of one position of one row, over every layer."""
        config = self.host.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = torch.finfo(self.host.dtype).bits // 8
        return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def until_empty(batch: SlotBatch) -> int:
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
    return steps


def profiled_steps(run: Callable[[], int], cuda: bool) -> Profile:
    """torch.profiler over `run()` (decode steps; it returns how many): device time, kernels, graph launches."""
    synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        steps = run()
        synchronize()
        wall = time.perf_counter() - started
    events = prof.events() or []
    if cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.device_time for e in device) / 1e6
        kernels = sum(1 for e in device if not e.name.startswith(("Memcpy", "Memset")))
    else:
        busy, kernels = (
            0.0,
            sum(
                1
                for e in events
                if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
            ),
        )
    launches = sum(1 for e in events if e.name in ("cudaGraphLaunch", "cuGraphLaunch"))
    return Profile(wall, busy, kernels, launches, steps)


def copy_bandwidth(device: str, cuda: bool) -> float:
    """Bytes/s of a large device-to-device copy (read and write counted), best of 10, CUDA events on a GPU."""
    size = 2**30 if cuda else 2**26
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(10):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - started)
    return 2 * size / min(times)


def hf_generate(
    args: argparse.Namespace, prompts: list[list[int]], pad: int, eos: int
) -> tuple[float, list[float], bool]:
    """HF `generate` with a static cache on the same rows: the warm-up call's seconds, each measured call's tokens/s,
    and whether transformers compiled the decode forward (on CUDA it does, given a static cache)."""
    from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

    cuda = args.device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    rows = [p for p in prompts for _ in range(args.samples)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.tokens,
        min_new_tokens=args.tokens,  # EOS masked: every row runs its whole length, as in the other rounds
        pad_token_id=pad,
        eos_token_id=eos,
        cache_implementation="static",
        compile_config=CompileConfig(fullgraph=True, dynamic=False) if cuda else None,
        disable_compile=not cuda,
    )

    def call() -> tuple[float, int]:
        synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        synchronize()
        if out.shape[1] - width != args.tokens:
            raise SystemExit(f"decode_gpu: HF generate made {out.shape[1] - width} tokens a row, not {args.tokens}")
        return time.perf_counter() - started, len(rows) * args.tokens

    warm, _ = call()
    rates = [tokens / seconds for seconds, tokens in (call() for _ in range(args.rounds))]
    return warm, rates, hasattr(model, "_compiled_call")


class Table:
    """The summary: figure, value, target, check. Targets are judged on CUDA only."""

    def __init__(self, judge: bool):
        self.judge = judge
        self.rows: list[tuple[str, str, str, str]] = []
        self.failed: list[str] = []
        self.errors: list[str] = []  # parts that raised: a failure on any device

    def add(self, figure: str, value: str, target: str = "", ok: bool | None = None) -> None:
        check = "" if ok is None else ("PASS" if ok else "FAIL") if self.judge else "not judged (cpu)"
        if self.judge and ok is False:
            self.failed.append(figure)
        self.rows.append((figure, value, target, check))

    def attempt(self, part: str, fn: Callable[[], None]) -> None:
        """Run one part of the check: one that raises is a row of the table, and the other parts' figures stay."""
        try:
            fn()
        except Exception as exc:
            traceback.print_exc()
            self.errors.append(part)
            self.rows.append((part, f"failed: {type(exc).__name__}: {str(exc)[:160]}", "runs", "FAIL"))

    def print(self, title: str) -> None:
        header = ("figure", "value", "target", "check")
        widths = [max(len(row[i]) for row in [header, *self.rows]) for i in range(4)]
        print(f"\n## {title}\n")
        for row in [header, tuple("-" * w for w in widths), *self.rows]:
            print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        print(flush=True)


def gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"


def static_path(
    table: Table, bench: Bench
) -> tuple[dict[bool, list[Round]], dict[str, Profile], int, dict[bool, SlotBatch]]:
    """The static path's rounds: one batch (one bucket, one graph) for the base model, one for the snapshots; a
    warm-up round each, then measured rounds alternating, then a profiled round each. Returns the rounds, the
    profiles, the LoRA table's bytes and the batches."""
    args, cuda = bench.args, bench.cuda
    batches = {
        lora: SlotBatch(bench.engine._bank, bench.host, compile="graphs" if cuda else None) for lora in (False, True)
    }
    warm, rounds = {}, {False: [], True: []}
    for lora in (False, True):
        warm[lora] = bench.round(batches[lora], lora)[0].seconds
        print(f"static, {'LoRA' if lora else 'base'}: warm-up round {warm[lora]:.1f} s", flush=True)
    for _ in range(args.rounds):  # alternating, so that both see the same machine
        for lora in (False, True):
            rounds[lora].append(bench.round(batches[lora], lora)[0])
            print(f"static, {'LoRA' if lora else 'base'}: {rounds[lora][-1].rate:,.0f} tokens/s", flush=True)
    for lora, label in ((False, "base"), (True, f"{args.prompts} LoRA snapshots mixed")):
        done = rounds[lora]
        table.add(
            f"static, {label}: round (prefill + {done[0].steps} steps)",
            f"{statistics.median(r.rate for r in done):,.0f} tokens/s (median of {len(done)})",
        )
        table.add(
            f"static, {label}: its decode steps",
            f"{statistics.median(r.decode_rate(bench.rows) for r in done):,.0f} tokens/s, "
            f"{1000 * statistics.median(r.decode_seconds / r.steps for r in done):.2f} ms a step",
        )
    how = "compile + capture" if cuda else "eager on cpu"
    table.add(f"static, warm-up round ({how}): base / LoRA", f"{warm[False]:.1f} s / {warm[True]:.1f} s")
    if cuda:  # a compiled step that cannot be a CUDA graph runs without one, and says so only here and in the log
        table.add("static, torch.compile's cudagraph skips", str(counters["inductor"]["cudagraph_skips"]))
    profiles = {}
    if "profile" not in args.skip:
        for lora in (False, True):
            profiles[f"static {'LoRA' if lora else 'base'}"] = bench.round(batches[lora], lora, profiled=True)[1]
    table_ = batches[True].table
    extra = sum(t.numel() * t.element_size() for t in (*table_._a.values(), *table_._b.values()))
    return rounds, profiles, extra, batches


def dynamic_path(table: Table, bench: Bench, static: list[Round], profiles: dict[str, Profile]) -> None:
    ms = {}
    for lora, label in ((False, "base"), (True, "LoRA mixed")):
        times, prof = bench.dynamic(lora)
        ms[lora] = 1000 * statistics.median(times)
        table.add(
            f"dynamic (DecodeBatch), {label}: decode steps",
            f"{ms[lora]:.1f} ms a step = {bench.rows / ms[lora] * 1000:,.0f} tokens/s (median of {len(times)} steps)",
        )
        if prof is not None:
            profiles[f"dynamic {label}"] = prof
    static_ms = 1000 * statistics.median(r.decode_seconds / r.steps for r in static)
    table.add("dynamic / static decode step, base", f"{ms[False] / static_ms:.1f}x the time")


def hf_rows(table: Table, bench: Bench, rounds: dict[bool, list[Round]]) -> None:
    warm, rates, compiled = hf_generate(bench.args, bench.prompts, bench.host.pad_token_id, bench.host.eos_token_id)
    hf = statistics.median(rates)
    how = "static cache + torch.compile" if compiled else "static cache, not compiled"
    table.add(f"HF generate, {how}, base", f"{hf:,.0f} tokens/s (median of {len(rates)}; warm-up call {warm:.1f} s)")
    ratio = statistics.median(r.rate for r in rounds[False]) / hf
    table.add("static round / HF generate, base", f"{ratio:.2f}x", f">= {HF_RATIO:.1f}x", ratio >= HF_RATIO)
    lora = statistics.median(r.rate for r in rounds[True]) / hf
    table.add("static round, LoRA mixed / HF generate, base", f"{lora:.2f}x")


def roofline_rows(table: Table, bench: Bench, rounds: dict[bool, list[Round]], bandwidth: float, extra: int) -> None:
    """The bytes a decode step must read over the copy bandwidth; `extra`: the LoRA table's stacked weights."""
    per_position = bench.kv_bytes_per_position()
    mean_length = statistics.mean(len(p) for p in bench.prompts) + (rounds[False][0].steps + 1) / 2
    kv = bench.rows * mean_length * per_position
    table.add("device-to-device copy bandwidth (read + write)", f"{bandwidth / 1e9:,.0f} GB/s")
    for lora, weights in ((False, bench.weight_bytes), (True, bench.weight_bytes + extra)):
        step = (weights + kv) / bandwidth
        table.add(
            f"roofline step, {'LoRA' if lora else 'base'}: (weights {gb(weights)} + KV {gb(kv)}) / bandwidth",
            f"{step * 1000:.3f} ms = {bench.rows / step:,.0f} tokens/s (KV at mean length {mean_length:.0f})",
        )
        share = statistics.median(r.decode_rate(bench.rows) for r in rounds[lora]) * step / bench.rows
        table.add(
            f"static decode steps / roofline, {'LoRA' if lora else 'base'}",
            f"{share:.1%}",
            "" if lora else f">= {ROOFLINE_SHARE:.0%}",
            None if lora else share >= ROOFLINE_SHARE,
        )
    capacity = rounds[False][0].capacity
    full = (bench.weight_bytes + bench.rows * capacity * per_position) / bandwidth
    table.add(
        f"roofline step at the bucket's {capacity} positions (the KV a static step reads), base",
        f"{full * 1000:.3f} ms = {bench.rows / full:,.0f} tokens/s",
    )


def deterministic_rows(table: Table, bench: Bench, default: SlotBatch, rounds: list[Round]) -> None:
    """The deterministic mode on the LoRA rounds (7. in the module docstring): `default` is the default path's LoRA
    batch, `rounds` its rounds."""
    args = bench.args
    fixed = fixed_bucket(bench.rows, bench.rows * rounds[0].capacity, bench.host.max_seq_len)
    batch = SlotBatch(bench.engine._bank, bench.host, compile="graphs" if bench.cuda else None, fixed=fixed)
    warm = bench.round(batch, True)[0].seconds
    print(f"deterministic, LoRA: warm-up round {warm:.1f} s", flush=True)
    done = [bench.round(batch, True)[0] for _ in range(args.rounds)]
    label = f"deterministic mode ({fixed[0]} rows x {fixed[1]} positions), {args.prompts} LoRA snapshots mixed"
    label += f" (table rank {FIXED_RANK}, the default's {default.table.rank})"
    for figure, rate in (("round", lambda r: r.rate), ("its decode steps", lambda r: r.decode_rate(bench.rows))):
        on, off = statistics.median(rate(r) for r in done), statistics.median(rate(r) for r in rounds)
        table.add(f"{label}: {figure}", f"{on:,.0f} tokens/s = {on / off:.2f}x the default path's {off:,.0f}")
    table.add(f"{label}: warm-up round", f"{warm:.1f} s")
    for name, probed, judged in (("default path", default, False), ("deterministic mode", batch, True)):
        started = time.perf_counter()
        alone, beside = bench.probe(probed, False), bench.probe(probed, True)
        print(f"probe, {name}: {time.perf_counter() - started:.1f} s", flush=True)
        same = next((i for i, (a, b) in enumerate(zip(alone[0], beside[0])) if a != b), len(alone[0]))
        compared = min(same + 1, len(alone[0]))  # the first token drawn apart is still drawn from the same context
        gap = max(abs(a - b) for a, b in zip(alone[1][:compared], beside[1][:compared]))
        table.add(
            f"probe row alone vs beside {bench.rows - args.samples} rows, {name}: max abs logprob diff",
            f"{gap:.3g} nats over {compared} tokens; tokens {'alike' if same == len(alone[0]) else f'apart from {same}'}",
            "0 (bitwise), tokens alike" if judged else "",
            gap == 0 and same == len(alone[0]) if judged else None,
        )


def profile_rows(table: Table, cuda: bool, profiles: dict[str, Profile]) -> None:
    unit = "kernels" if cuda else "top-level aten operators (cpu)"
    table.add(
        f"{unit} a step: " + " / ".join(profiles), " / ".join(f"{p.kernels / p.steps:,.0f}" for p in profiles.values())
    )
    if not cuda:
        table.add("GPU busy, CUDA graph launches", "not measured on cpu (no CUDA profiler)")
        return
    for name, p in profiles.items():
        judged = name == "static base"
        table.add(
            f"GPU busy, {name} ({p.steps} steps profiled)",
            f"{p.busy / p.wall:.0%} of {p.wall:.2f} s; {p.graph_launches / p.steps:.1f} CUDA graph launches a step",
            f">= {BUSY_SHARE:.0%}" if judged else "",
            p.busy / p.wall >= BUSY_SHARE if judged else None,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (gpu_check.sh: SmolLM2-1.7B's shapes)")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run of this script)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts, each on its own snapshot in LoRA rounds")
    parser.add_argument("--samples", type=int, default=8, help="rows per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row")
    parser.add_argument("--prompt_length", type=int, default=64, help="prompts' mean length (they differ by one)")
    parser.add_argument("--rank", type=int, default=32, help="the snapshots' LoRA rank")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds of each path (after a warm-up)")
    parser.add_argument("--dynamic_steps", type=int, default=8, help="timed (and as many profiled) dynamic steps")
    parser.add_argument(
        "--skip", default="", help="parts left out, comma-separated: dynamic, hf, profile, deterministic"
    )
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("decode_gpu: no CUDA device")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    if not cuda:
        print("cpu: a smoke run. The static path runs eagerly (CUDA graphs are CUDA's), HF generate without compile,")
        print("     the profiler counts CPU operators (no kernels, no busy share); no target is judged.", flush=True)
    started = time.perf_counter()
    bench = Bench(args)
    print(f"engine up, {args.prompts} sessions trained and snapshotted in {time.perf_counter() - started:.0f} s")
    table = Table(judge=cuda)
    bandwidth = copy_bandwidth(args.device, cuda)
    rounds, profiles, extra, batches = static_path(table, bench)
    gaps = bench.logprob_gaps(rounds[True][-1].jobs)
    if "dynamic" not in args.skip:
        table.attempt("dynamic path", lambda: dynamic_path(table, bench, rounds[False], profiles))
    if "hf" not in args.skip:
        table.attempt("HF generate", lambda: hf_rows(table, bench, rounds))
    roofline_rows(table, bench, rounds, bandwidth, extra)
    if profiles:
        profile_rows(table, cuda, profiles)
    table.add(
        f"sampled vs trainer logprob, LoRA round ({gaps.size:,} tokens): mean / max abs gap",
        f"{gaps.mean():.4f} / {gaps.max():.3f} nats",
        f"mean <= {MEAN_GAP}",
        bool(gaps.mean() <= MEAN_GAP),
    )
    lengths = sorted(len(p) for p in bench.prompts)
    table.print(
        f"decode on {name}, {args.model} (bf16): {args.prompts} prompts of {lengths[0]}-{lengths[-1]} tokens x "
        f"{args.samples} samples = {bench.rows} rows x {args.tokens} tokens, T=1, no stop"
    )
    print(f"decode_gpu: the table above took {time.perf_counter() - started:.0f} s", flush=True)
    # Its own table, printed after the one above: what it costs (two compiles) never holds the others back.
    deterministic = Table(judge=cuda)
    if "deterministic" not in args.skip:
        deterministic.attempt(
            "deterministic mode", lambda: deterministic_rows(deterministic, bench, batches[True], rounds[True])
        )
        deterministic.print(f"the deterministic mode (--sampler_deterministic_rows) on {name}")
    print(f"decode_gpu took {time.perf_counter() - started:.0f} s", flush=True)
    bench.engine.close()
    failed = [*(f"{e} failed" for e in [*table.errors, *deterministic.errors]), *table.failed, *deterministic.failed]
    if failed:
        raise SystemExit("decode_gpu: " + "; ".join(failed))


if __name__ == "__main__":
    main()
