"""A stand-in for the vLLM engine process (treadle/gpu_worker/sampling/vllm/server.py's protocol, no vLLM): what
`tests/test_vllm_link.py` kills and restarts where no vLLM is installed.

    python tests/vllm_stand_in.py SOCKET_FD

It answers a sample request with its prompt reversed as the tokens, after `params["delay_s"]` seconds; a request
with `params["crash"]` makes it exit at once, as an engine that dies on it would.
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
    send_lock = threading.Lock()

    def send(message: dict) -> None:
        with send_lock:
            conn.sendall((json.dumps(message) + "\n").encode())

    def answer(message: dict) -> None:
        time.sleep(message["params"].get("delay_s", 0))
        tokens = message["prompt"][::-1]
        send(
            {
                "id": message["id"],
                "sequences": [{"tokens": tokens, "logprobs": [-1.0] * len(tokens), "finish_reason": "length"}],
            }
        )

    send({"ready": True})
    for line in conn.makefile("rb"):
        message = json.loads(line)
        if message["op"] == "remove_lora":
            send({"id": message["id"], "removed": True})
        elif message["params"].get("crash"):
            os._exit(3)
        else:
            threading.Thread(target=answer, args=(message,), daemon=True).start()


if __name__ == "__main__":
    main()
