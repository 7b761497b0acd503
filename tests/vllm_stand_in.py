"""A stand-in for the vLLM engine process (treadle/gpu_worker/sampling/vllm/server.py's protocol, no vLLM): what
`tests/test_vllm_link.py` kills and restarts where no vLLM is installed.

    python tests/vllm_stand_in.py SOCKET_FD

It answers a sample request with its prompt reversed as the tokens of each of its `n` samples, after
`params["delay_s"]` seconds; a streamed one sends them one step at a time, one every `params["step_s"]` seconds
(sample k's token at step i: the i-th of them plus k, logprob -i), and an abort drops it between two steps. A
request with `params["crash"]` makes it exit at once, as an engine that dies on it would.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[-1]))
    lock = threading.Lock()  # one message at a time; and a request is answered or aborted, not both
    drawn: dict[int, int] = {}  # request in flight -> the steps it has streamed
    rows: dict[int, int] = {}  # request -> its n

    def send(message: dict) -> None:
        conn.sendall((json.dumps(message) + "\n").encode())

    def answer(message: dict) -> None:
        mid, params, prompt = message["id"], message["params"], message["prompt"][::-1]
        n = params.get("n", 1)
        time.sleep(params.get("delay_s", 0))
        for i, token in enumerate(prompt if message.get("stream") else []):
            with lock:
                if mid not in drawn:
                    return  # aborted
                send({"id": mid, "rows": list(range(n)), "tokens": [token + k for k in range(n)], "logprobs": [-i] * n})
                drawn[mid] += 1
            time.sleep(params.get("step_s", 0))
        sequences = [
            {
                "tokens": [t + k for t in prompt],
                "logprobs": [-float(i) for i in range(len(prompt))],
                "finish_reason": "length",
            }
            for k in range(n)
        ]
        with lock:
            if drawn.pop(mid, None) is not None:
                send({"id": mid, "sequences": sequences})

    def abort(message: dict) -> None:
        with lock:
            steps = drawn.pop(message["request"], None)
            if steps is not None:
                cancelled = [steps] * rows[message["request"]]
                send({"id": message["request"], "cancelled": cancelled, "rows_left": sum(rows[m] for m in drawn)})
            send({"id": message["id"], "aborted": steps is not None})

    with lock:
        send({"ready": True})
    for line in conn.makefile("rb"):
        message = json.loads(line)
        if message["op"] == "remove_lora":
            with lock:
                send({"id": message["id"], "removed": True})
        elif message["op"] == "abort":
            abort(message)
        elif message["params"].get("crash"):
            os._exit(3)
        else:
            with lock:
                drawn[message["id"]], rows[message["id"]] = 0, message["params"].get("n", 1)
            threading.Thread(target=answer, args=(message,), daemon=True).start()


if __name__ == "__main__":
    main()
