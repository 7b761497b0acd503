"""The worker's options (`treadle worker --help` is generated from this model): models, devices, the sampler,
checkpointing, leases, the hand-off, fair shares and queue bounds, metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from treadle.queue.celery_app import RESULT_EXPIRES_S
from treadle.queue.sample_options import MAX_TOPK_SAMPLE_LOGPROBS
from treadle.types.base import DEFAULT_MAX_IMAGE_PIXELS


class WorkerConfig(BaseModel):
    model: list[str] = Field(description="Base models to serve: a hub id, a local dir, or NAME=DIR (served as NAME).")
    broker_url: str | None = Field(default=None, description="Redis URL (default: TREADLE_BROKER_URL).")
    result_url: str | None = Field(default=None, description="Result backend URL (default: the broker).")
    storage_url: str | None = Field(
        default=None, description="Checkpoint store: file:///dir or s3://bucket/prefix (default: TREADLE_STORAGE_URL)."
    )
    hostname: str | None = Field(default=None, description="Celery node name (default: treadle-<random>@<host>).")
    device: str | None = Field(default=None, description="cpu, cuda, cuda:1, ... (default: what Accelerate picks).")
    dtype: str | None = Field(default=None, description="float32 or bfloat16 (default: bf16 on CUDA, fp32 on CPU).")
    devices: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks of this worker's device group on this host (data parallel, one process each: cuda:0..N-1, or N CPU processes); rank 0 of host 0 consumes the queues.",
    )
    shard: bool = Field(
        default=False,
        description="Shard each base model's weights over the group's ranks (FSDP2): a model larger than one device fits the group (docs/scaling.md; `treadle models check MODEL --devices N --shard --memory_gb G` says whether it does).",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Hosts of the device group, each running `treadle worker` with --devices ranks.",
    )
    node_rank: int = Field(
        default=0,
        ge=0,
        description="This host's place in the group (0: the host of rank 0, the Celery consumer; others only compute).",
    )
    master_addr: str = Field(
        default="127.0.0.1",
        description="With --nnodes > 1: the address of host 0, where the ranks meet (torch.distributed's TCP rendezvous).",
    )
    master_port: int = Field(
        default=29500,
        ge=1,
        le=65534,
        description="With --nnodes > 1: the rendezvous port on host 0; the next port takes the other hosts' calls to rank 0.",
    )
    checkpoint_every: int = Field(
        default=10, ge=0, description="Checkpoint each session every N optimizer steps (0: never)."
    )
    checkpoint_journal_ops: int = Field(
        default=1000,
        ge=0,
        description="Also checkpoint a session once this many of its ops ran since its last checkpoint, whatever they are: only a checkpoint trims the op journal in Redis, and a loop that runs forward or forward_backward ops without optimizer steps would keep every request there (0: off).",
    )
    checkpoint_interval_s: float = Field(
        default=0.0,
        ge=0.0,
        description="Also checkpoint a session when this many seconds passed since its last one (0: off).",
    )
    idle_unload_s: float = Field(
        default=1800.0,
        ge=0.0,
        description="Checkpoint and unload a session after this many idle seconds, freeing accelerator memory; it reloads on its next op (0: never).",
    )
    lease_ttl_s: float = Field(
        default=15.0, gt=0.5, description="Session lease TTL: how soon another worker adopts a dead worker's sessions."
    )
    max_tokens_per_microbatch: int | None = Field(
        default=None,
        ge=64,
        description="Token budget of one forward/backward micro-batch (also of one sampling prefill). Default: 4096 "
        "on a CPU; on CUDA the largest power of two up to 32768 (and at least 4096) whose estimated activations fit "
        "half the memory the weights leave (docs/scaling.md).",
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Checkpoint each decoder layer's activations in forward_backward (the backward pass runs the layer "
        "again instead of keeping what it computed: about a third more compute, a fraction of the memory). auto: for "
        "a micro-batch whose estimated activations would not fit (one sequence longer than the token budget, or, on "
        "CUDA, more than half the memory the weights leave); on: every micro-batch; off: never (docs/scaling.md).",
    )
    full_session_memory: int = Field(
        default=0,
        ge=0,
        description="Bytes the full fine-tuning sessions of one base model may hold in all (weights, gradients, AdamW "
        "moments, activations, their sampler snapshots; on a sharded group a rank's); a session or snapshot that would "
        "pass it is refused. 0: the device's free memory when it is made (the host's available memory on a CPU).",
    )
    sampling_max_batch_tokens: int = Field(
        default=16384,
        ge=64,
        description="KV-cache budget of the batched sampler, in positions (rows x padded length, each row counted at its "
        "full max_tokens). Memory: 2 x layers x kv_heads x head_dim x dtype bytes per position, e.g. 46 KB "
        "for SmolLM2-135M in fp32 (16384 ~ 0.75 GB); more lets more requests share each decode step.",
    )
    sampling_prefix_cache_tokens: int = Field(
        default=16384,
        ge=0,
        description="KV positions the hf sampler keeps of prompts and of one-sample answers, per base model, so that a "
        "prompt starting with tokens already run on the same snapshot (a GRPO group sent one by one, a conversation's "
        "next turn) is prefilled only from where they end; least recently used first out. One position costs what a "
        "batch position does (2 x layers x kv_heads x head_dim x dtype bytes: 46 KB for SmolLM2-135M in fp32), each "
        "kept prompt also its last logits (vocab x dtype bytes). 0: no reuse (treadle.gpu_worker.sampling.hf.prefix_cache).",
    )
    max_image_pixels: int = Field(
        default=DEFAULT_MAX_IMAGE_PIXELS,
        ge=1,
        description="Largest image (width x height) a vision-language model's requests may carry; a larger one is "
        "refused, naming its chunk, before its pixels are decoded.",
    )
    sampler: Literal["auto", "hf", "vllm"] = Field(
        default="auto",
        description="What samples: hf (batched transformers decoding in this process) or vllm (a vLLM engine per base "
        "model in a child process with its own venv: scripts/setup_vllm.sh). auto: vllm when CUDA and vLLM "
        "are both there (and no --sampler_deterministic_rows), hf otherwise; the log says which.",
    )
    sampler_decode: Literal["auto", "static", "dynamic"] = Field(
        default="auto",
        description="How the hf sampler runs decode steps: static (fixed-shape steps, captured as CUDA graphs on a GPU; "
        "the families that take it are listed by `treadle models check`) or dynamic (eager steps over a growing "
        "cache). auto: static on CUDA where the family takes it, dynamic otherwise (on a CPU the dynamic path is faster).",
    )
    sampler_deterministic_rows: int = Field(
        default=0,
        ge=0,
        description="The hf sampler's deterministic mode on a GPU (0: off): every static decode step runs this many "
        "rows (rounded up to a multiple of 8) of sampling_max_batch_tokens / rows positions each, each prompt is "
        "prefilled alone and from no kept prefix, so a seeded request gives the same tokens and logprobs whatever "
        "shares its batch (a resumed RL run reproduces). Costs speed: steps always run the whole bucket, prefills one "
        "by one (gpu_check's decode part measures it). A request with more samples than rows, or longer than a row's "
        "positions, decodes beside without the guarantee. With it `--sampler auto` is hf. On a CPU the default "
        "(dynamic) steps are batch-invariant without it.",
    )
    vllm_python: str | None = Field(
        default=None,
        description="Interpreter of vLLM's venv (default: $TREADLE_VLLM_PYTHON, else .venv-vllm/bin/python of the checkout).",
    )
    vllm_max_lora_rank: int = Field(
        default=32,
        ge=1,
        le=512,
        description="vLLM: largest LoRA rank a snapshot may have (vLLM sizes its kernels by it); larger ones are refused.",
    )
    vllm_max_loras: int = Field(
        default=4,
        ge=1,
        description="vLLM: adapters that can share one batch (GPU slots); more are swapped in least recently used first out.",
    )
    vllm_memory_share: float = Field(
        default=0.3,
        gt=0.0,
        lt=1.0,
        description="vLLM: share of the GPU's memory its engine takes (weights, KV cache); training uses the rest. On CPU see vllm_cpu_kv_cache_gib.",
    )
    vllm_cpu_kv_cache_gib: int = Field(default=1, ge=1, description="vLLM on CPU: KV cache size in GiB.")
    vllm_max_logprobs: int = Field(
        default=64,
        ge=0,
        description="vLLM: most top-k prompt logprobs a request may ask for (a sampled token's top-k, at most "
        f"{MAX_TOPK_SAMPLE_LOGPROBS}, is served whatever this is).",
    )
    session_idle_ttl_s: float = Field(
        default=86400.0,
        ge=0.0,
        description="Checkpoint and stop (expire) a session after this many idle seconds; its client gets SessionExpiredError naming the checkpoint to resume from (0: never).",
    )
    full_session_memory_per_owner: int | None = Field(
        default=None,
        ge=1,
        description="Bytes one owner's full fine-tuning sessions may hold in all (weights, gradients, AdamW moments); a "
        "create past it fails with QuotaExceededError (None: unlimited). Give every worker the same limit.",
    )
    max_sessions_per_owner: int | None = Field(
        default=None,
        ge=1,
        description="Concurrent training sessions one owner may run (a gateway API key's owner; `sdk` for treadle SDK sessions); an over-quota create fails with QuotaExceededError (None: unlimited). Give every worker the same limits.",
    )
    owner_session_limits: dict[str, int] = Field(
        default_factory=dict, description='Per-owner overrides of max_sessions_per_owner, JSON: {"alice": 8}.'
    )
    owner_weights: dict[str, float] = Field(
        default_factory=dict,
        description='Per-owner weights of the fair share of a worker\'s device time, JSON: {"alice": 2} (others: 1). When several sessions have ops ready, each turn goes to the owner with the least measured device time over its weight (treadle.gpu_worker.scheduling.fair). Give every worker the same weights.',
    )
    max_queued_ops_per_session: int = Field(
        default=256,
        ge=0,
        description="Ops one session may have submitted and not yet run; a submit past it is refused with CapacityError (HTTP 429 with Retry-After at the gateway; the treadle SDK waits for room up to its TREADLE_CAPACITY_WAIT_S) and queues nothing (0: no bound). Applies to sessions created from then on.",
    )
    max_queued_ops_per_owner: int = Field(
        default=1024,
        ge=0,
        description="Ops all active sessions of one owner may have queued together; past it as above (0: no bound).",
    )
    max_queued_sample_rows_per_owner: int = Field(
        default=4096,
        ge=0,
        description="Sample rows (num_samples summed over requests) one owner may have submitted and not yet answered; past it a sample request is refused with CapacityError (HTTP 429 with Retry-After; the treadle SDK waits for room) and queues nothing, unless nothing of the owner is queued (0: no bound). Published for clients to check; give every worker the same.",
    )
    max_request_crashes: int = Field(
        default=2,
        ge=1,
        description="A request (sample, compute_logprobs, create_session, a session's op) whose workers died while running it this many times is not run again: the next worker answers it with CrashingRequestError and logs it, so that one request that crashes its worker (a prefill that gets the process OOM-killed, a kernel that segfaults) cannot take down every worker of its model in turn. Give every worker the same.",
    )
    logprob_audit_fraction: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Share of sampled sequences (temperature 1, no top-k/top-p) whose logprobs the worker recomputes with the training forward of the same snapshot, off the decode path, exporting the gap as treadle_sampler_logprob_gap (treadle.gpu_worker.sampling.logprob_audit; 0: off).",
    )
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Serve Prometheus metrics on this port (0: off).")
    metrics_address: str = Field(
        default="127.0.0.1", description="Interface of the metrics port (0.0.0.0 inside a private network)."
    )
    linger_ms: float = Field(
        default=20.0,
        ge=0.0,
        le=10000.0,
        description="After running a session's ops, wait this long for the next op of any session this worker owns before going back to Celery: a loop that submits its next step right after reading a result then costs no Celery message (treadle.gpu_worker.scheduling.linger). A sample request or session creation arriving meanwhile ends the wait within 5 ms (0: off).",
    )
    anticipate_ms: float = Field(
        default=20.0,
        ge=0.0,
        le=10000.0,
        description="When the session that has just run an op is owed the device and has no next op yet while others have ops ready, wait this long for its next op before giving the turn away, and charge the wait to it: a light loop beside a tenant that pipelines heavy ops then runs its steps back to back instead of waiting for a heavy op before each (treadle.gpu_worker.scheduling.linger; 0: off).",
    )
    result_ttl_s: int = Field(
        default=RESULT_EXPIRES_S,
        ge=1,
        le=365 * 24 * 3600,
        description="How long each op's result stays in Redis for its future to read (the SDK, the gateway's re-polls). Every forward_backward's logprobs are kept that long whether or not anyone reads them, so this bounds the results' share of Redis memory; a future read after it fails with NotFoundError (default: 7 days).",
    )
    task_events: bool = Field(
        default=False,
        description="Send Celery task events (received, started, succeeded, failed) so that Flower lists and times ops; off by default: they cost about a third of the worker's CPU per op.",
    )
    loglevel: str = Field(default="INFO", description="Log level.")
