"""The SDK's tokenizer, loaded from the files a worker publishes, by several client processes at once.

A run's restarted attempt and the uninterrupted loop beside it load the same model's tokenizer at the same
moment. Each must get the whole tokenizer: a client that read a chat template another was rewriting rendered
every prompt empty, and its sample requests were refused ("prompt: empty").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One client process: load the tokenizer `LOADS` times (as many fresh processes would) and render a prompt each time.
CLIENT = textwrap.dedent(
    """
    import os, sys
    from treadle.sdk import tokenizer
    from treadle.recipes.lib.evaluation import question_prompt

    model_dir, loads = sys.argv[1], int(sys.argv[2])
    files = {n: open(os.path.join(model_dir, n), "rb").read() for n in os.listdir(model_dir) if "token" in n or "chat" in n}

    class Published:  # what OpsClient.tokenizer_files reads from Redis: the worker's files, by name
        def tokenizer_files(self, base_model):
            return files

    for _ in range(loads):
        tokenizer._CACHE.clear()  # a fresh client process has none
        prompt = question_prompt(tokenizer.load_tokenizer(Published(), "tiny"), "What is 1 + 2?", None)
        assert prompt, "the chat template rendered an empty prompt"
    print("ok")
    """
)


def test_client_processes_loading_one_tokenizer_at_once_each_render_whole_prompts(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, tiny_model_dir, "40"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [client.communicate(timeout=300)[0] for client in clients]
    assert [client.returncode for client in clients] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
