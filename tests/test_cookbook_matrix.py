"""Every tinker-cookbook 0.6.1 recipe that can run offline, run unchanged against the gateway, two steps each.

Each recipe runs as a user runs it, `python -m tinker_cookbook.recipes.<name>` in a subprocess, with only
TINKER_BASE_URL and TINKER_API_KEY pointing it at treadle and only the recipe's public CLI options: the
model name (the tiny model serves it), small batches, two steps, no evals or periodic saves. What the
recipes download is in an offline Hugging Face cache instead: the tiny model under the served names and a
few rows of each dataset, written by `seed_dataset` in the layout `datasets.load_dataset` reads offline.
The tiny model here is the Qwen2 one with the special tokens Qwen3.5's renderer asserts are single tokens
(`<think>`, `</think>`, ...) and room for the 2048 new tokens graders and teachers ask for.

The gateway runs with `--loss_alias stable_reinforce=cispo`, so the recipes whose default loss is
stable_reinforce (rl_loop, math_rl, rubric) run with their defaults. The recipes that need a network
service or an audio model are listed in NOT_RUN with the reason. vlm_classifier runs on a tiny Qwen2.5-VL
served under its default model's name, on synthetic images in caltech101's layout. The last test checks that
docs/tinker-compatibility.md's recipes section is the table `render` makes of RECIPES and NOT_RUN
(`python scripts/report_compat.py` writes it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import pytest

from tests.fixtures.gateway import ALICE_KEY
from tests.reports import COMPAT, COOKBOOK_SECTION, compat_sections, stale
from treadle.gateway.server import BackgroundGateway
from treadle.gateway.settings import GatewaySettings
from treadle.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

MODEL = "Qwen/Qwen3.5-4B"  # what every recipe is told to train and sample
RENDERER = "qwen3_5"  # the cookbook's recommended renderer for MODEL
TEACHER = "Qwen/Qwen3.6-35B-A3B"  # prompt_distillation's data stage samples this name, with no option to change it
ANSWERER = "Qwen/Qwen3.5-9B"  # twenty_questions' answerer, likewise fixed
SERVED = (MODEL, TEACHER, ANSWERER)
VLM = "Qwen/Qwen3.5-397B-A17B"  # vlm_classifier's default model: a tiny Qwen2.5-VL serves it
REVISION = "0123456789abcdef0123456789abcdef01234567"
RUN_TIMEOUT_S = 900
COMMON = ("max_steps=2", "eval_every=0", "save_every=0")  # every log_path is new, so no recipe asks to overwrite


@dataclass(frozen=True)
class Stage:
    module: str  # under tinker_cookbook.recipes
    args: tuple[str, ...] = ()
    stdin: str = ""
    metrics_rows: int = 2  # rows the stage's log/metrics.jsonl must hold (0: the stage writes no metrics)


@dataclass(frozen=True)
class Recipe:
    name: str
    stages: tuple[Stage, ...]
    note: str = ""
    tags: tuple[str, ...] = field(default=())


def _rl(module: str, *args: str, rows: int = 2) -> Stage:
    return Stage(module, (f"model_name={MODEL}", *COMMON, *args), metrics_rows=rows)


def _builder(factory: str, *fields: str) -> tuple[str, ...]:
    """A config-template recipe's dataset builder, given again on its command line with smaller batches: chz
    takes a builder only whole, and the template's own (batch 128) would make a two-step run take minutes."""
    return (f"dataset_builder=tinker_cookbook.recipes.{factory}", *(f"dataset_builder.{f}" for f in fields))


RECIPES = [
    Recipe(
        "sl_basic",
        (
            Stage(
                "sl_basic",
                (
                    f"model_name={MODEL}",
                    *COMMON,
                    *_builder(
                        "chat_sl.chat_datasets:NoRobotsBuilder",
                        "common_config.batch_size=8",
                        "common_config.max_length=512",
                        f"common_config.model_name_for_tokenizer={MODEL}",
                        f"common_config.renderer_name={RENDERER}",
                    ),
                ),
            ),
        ),
        "no_robots; its dataset builder given again with batch 8",
    ),
    Recipe("sl_loop", (Stage("sl_loop", (f"model_name={MODEL}", "batch_size=8", "max_steps=2", "save_every=0")),)),
    Recipe("chat_sl", (_rl("chat_sl.train", "batch_size=8"),), "no_robots"),
    Recipe(
        "prompt_distillation",
        (
            Stage("prompt_distillation.create_data", ("output_file=data/lang.jsonl",), metrics_rows=0),
            _rl("prompt_distillation.train", "file_path=lang.jsonl", "batch_size=4", "lora_rank=8"),
        ),
        "data stage on 8 sentences; the train stage on a local file of its format (a random model never writes "
        "the `Final Answer: xx` the data stage keeps)",
    ),
    Recipe(
        "rl_basic",
        (
            Stage(
                "rl_basic",
                (
                    f"model_name={MODEL}",
                    *COMMON,
                    "max_tokens=8",
                    *_builder(
                        "math_rl.math_env:Gsm8kDatasetBuilder",
                        "batch_size=4",
                        "group_size=2",
                        f"renderer_name={RENDERER}",
                        f"model_name_for_tokenizer={MODEL}",
                    ),
                ),
            ),
        ),
        "GSM8K; its dataset builder given again with 4 x 2 samples a step",
    ),
    Recipe(
        "rl_loop",
        (
            Stage(
                "rl_loop",
                (f"model_name={MODEL}", "batch_size=2", "group_size=4", "max_tokens=12", "max_steps=2", "save_every=0"),
            ),
        ),
        "default loss stable_reinforce (aliased)",
    ),
    Recipe(
        "math_rl",
        (_rl("math_rl.train", "groups_per_batch=4", "group_size=4", "max_tokens=16", rows=3),),
        "arithmetic; default loss stable_reinforce (aliased)",
    ),
    Recipe(
        "math_rl (async)",
        (
            _rl(
                "math_rl.train", "groups_per_batch=4", "group_size=4", "max_tokens=16", "max_steps_off_policy=1", rows=3
            ),
        ),
        "max_steps_off_policy=1",
    ),
    Recipe(
        "guess_number", (_rl("multiplayer_rl.guess_number.train", "batch_size=2", "group_size=2", "max_tokens=16"),)
    ),
    Recipe("twenty_questions", (_rl("multiplayer_rl.twenty_questions.train", "batch_size=2", "group_size=2"),)),
    Recipe(
        "text_arena",
        (
            _rl(
                "multiplayer_rl.text_arena.train",
                "batch_size=2",
                "num_train_datapoints=8",
                "num_test_datapoints=2",
                "max_tokens=16",
            ),
        ),
        "TicTacToe-v0, self-play",
    ),
    Recipe(
        "rl_numerics_check",
        (
            _rl(
                "rl_numerics_check.train",
                "groups_per_batch=2",
                "group_size=2",
                "max_tokens=16",
                "task.page_chars=200",
                "task.num_pages_min=2",
                "task.num_pages_max=3",
            ),
        ),
        "wikitext, documents of 2-3 pages of 200 characters",
    ),
    Recipe("dpo", (Stage("preference.dpo.train", (f"model_name={MODEL}", "batch_size=8", "max_steps=2")),), "hh-rlhf"),
    Recipe(
        "shorter",
        (
            Stage(
                "preference.shorter.train",
                (f"model_name={MODEL}", "batch_size=2", "group_size=2", "max_tokens=16", "max_steps=2", "eval_every=0"),
            ),
        ),
    ),
    Recipe(
        "rlhf_pipeline",
        (
            Stage(
                "preference.rlhf.rlhf_pipeline",
                (
                    f"base_model={MODEL}",
                    "batch_size=8",
                    "rl_group_size=2",
                    "rl_max_tokens=16",
                    "max_steps=2",
                    "save_every=0",
                    "eval_every=0",
                ),
                metrics_rows=0,
            ),
        ),
        "SFT, reward model, RL: three stages in one run, logged under ~/tinker-runs",
    ),
    Recipe(
        "on_policy_distillation",
        (
            _rl(
                "distillation.on_policy_distillation",
                f"teacher_model={MODEL}",
                "groups_per_batch=2",
                "group_size=2",
                "max_tokens=16",
                "lora_rank=8",
            ),
        ),
        "DeepMath; the base model as teacher",
    ),
    Recipe(
        "on_policy_multi_teacher",
        (
            _rl(
                "distillation.on_policy_multi_teacher",
                f"deepmath_teacher_model={MODEL}",
                f"tulu3_teacher_model={MODEL}",
                "deepmath_groups_per_batch=2",
                "tulu3_groups_per_batch=2",
                "group_size=2",
                "max_tokens=16",
                "lora_rank=8",
            ),
        ),
        "DeepMath and Tulu 3, two base-model teachers",
    ),
    Recipe(
        "sdft",
        (_rl("sdft.train", "groups_per_batch=2", "max_tokens=16", "lora_rank=8"),),
        "SciKnowEval; top-k [N, K] cross_entropy",
    ),
    Recipe(
        "sdft (reverse)",
        (_rl("sdft.train", "groups_per_batch=2", "max_tokens=16", "lora_rank=8", "reverse=True"),),
        "[N, K] logprobs into forward_backward_custom",
    ),
    Recipe(
        "rubric",
        (
            Stage("rubric.generate_data", metrics_rows=0),
            _rl("rubric.train", f"grader_llm_name={MODEL}", "groups_per_batch=2", rows=3),
        ),
        "an LLM grader on the base model; default loss stable_reinforce (aliased)",
    ),
    Recipe(
        "decisions.demo",
        (
            Stage(
                "decisions.demo", (f"model_name={MODEL}",), stdin="How do I pick a learning rate?\n\n", metrics_rows=0
            ),
        ),
        "target_prompt_logprobs",
    ),
    Recipe(
        "true_thinking_score",
        (
            Stage(
                "true_thinking_score.analyze",
                (f"model_name={MODEL}", "dataset=gsm8k", "n_problems=1", "max_tokens=64"),
                metrics_rows=0,
            ),
        ),
        "`analyze` on one GSM8K problem: chain-of-thought steps scored by prompt logprobs",
    ),
    Recipe(
        "chat_app",
        (Stage("chat_app", (f"base_model={MODEL}", "max_tokens=16"), stdin="hello\nquit\n", metrics_rows=0),),
        "`tinker_cookbook.chat_app.tinker_chat_cli`",
    ),
    Recipe(
        "vlm_classifier",
        (
            Stage(
                "vlm_classifier.train",
                (
                    "experiment_dir=vlm",
                    "behavior_if_log_dir_exists=delete",
                    *COMMON,
                    "infrequent_eval_every=0",
                    "batch_size=2",
                    "lora_rank=8",
                    "max_length=512",
                    "run_sampling_evaluator=False",
                ),
                metrics_rows=0,  # no log_path option: its log is experiment_dir/<run name> (`_check_output`)
            ),
        ),
        f"caltech101's layout with 4 synthetic images a split; {VLM} served by a tiny Qwen2.5-VL",
    ),
]

NETWORK = "needs a network service"
NOT_RUN = {
    "code_rl": f"{NETWORK}: code runs in a sandbox service (Sandbox Fusion or Modal), and LiveCodeBench's tests come from the Hub",
    "search_tool": f"{NETWORK}: a Chroma vector store and a Gemini embedding API",
    "verifiers_rl": f"{NETWORK}: its environments are installed from the Prime Intellect environments hub",
    "harbor_rl": f"{NETWORK}: Harbor task containers (Docker or a cloud sandbox)",
    "distillation.on_policy_distillation_harbor_multi_turn": f"{NETWORK}: Harbor task containers",
    "forecasting": f"{NETWORK}: it downloads the Prophet Arena CSV over HTTP, outside the datasets cache",
    "decisions.forecasting": f"{NETWORK}: it downloads the Prophet Arena CSV over HTTP, as forecasting does",
    "distillation.off_policy_reasoning": f"{NETWORK}: it streams OpenThoughts3 from the Hub (`streaming=True`), which "
    "reads the Hub's files, not the offline datasets cache this matrix fills",
    "true_thinking_score.run_small_experiment": "left out for time: its three built-in problems at full length take "
    "about 90 s on the tiny model; `analyze` (above) runs the same scoring",
    "chat_sl.sweep": "a launcher of chat_sl hyperparameter sweeps (many full-length runs); chat_sl runs above",
    "decisions.train": "helpers for training a decision model, no entry point of its own; decisions.demo runs above",
    "helper entry points": "evaluation, benchmark and debugging scripts of recipes that run above (text_arena.play, "
    "rubric.debug_env, rubric.prometheus_experimental, sdft.benchmark, sdft.run_continual_learning): not yet in this matrix",
    "audio (asr, emotion, medical_asr)": "an audio model (audio inputs); treadle serves text models",
}


def seed_dataset(
    home: Path, repo: str, config: str | None, splits: dict[str, list[dict]], features: dict | None = None
) -> None:
    """Rows in the offline cache as `datasets.load_dataset(repo, config)` finds them with HF_HUB_OFFLINE=1:
    prepared once by the json builder (with `features` where JSON cannot say them: images, class labels), then
    moved under the repo's cache name (its last part in snake case)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    work = home / "seed" / repo.replace("/", "--") / (config or "default")
    work.mkdir(parents=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    typed = datasets.Features(features) if features else None
    datasets.load_dataset("json", data_files=files, cache_dir=str(work / "cache"), features=typed)
    source = Path(glob.glob(str(work / "cache" / "json" / "*" / "*" / "*"))[0])
    name = camelcase_to_snakecase(repo.split("/")[-1])
    target = (
        home
        / "datasets"
        / "___".join([*repo.split("/")[:-1], name])
        / (config or "default")
        / source.parent.name
        / source.name
    )
    target.mkdir(parents=True)
    for path in source.iterdir():
        shutil.copy(path, target / path.name.replace("json-", f"{name}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name=config or "default", dataset_name=name, builder_name=name)
    (target / "dataset_info.json").write_text(json.dumps(info))


def _chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _seed_datasets(home: Path) -> None:
    chats = [_chat(f"What is {i} plus one?", f"It is {i + 1}.") for i in range(300)]
    seed_dataset(
        home,
        "HuggingFaceH4/no_robots",
        None,
        {
            "train": [
                {"prompt": m[0]["content"], "prompt_id": str(i), "category": "Chat", "messages": m}
                for i, m in enumerate(chats)
            ],
            "test": [
                {"prompt": m[0]["content"], "prompt_id": str(i), "category": "Chat", "messages": m}
                for i, m in enumerate(chats[:8])
            ],
        },
    )
    seed_dataset(
        home,
        "allenai/tulu-3-sft-mixture",
        None,
        {"train": [{"id": str(i), "source": "x", "messages": m} for i, m in enumerate(chats)]},
    )
    gsm8k = [{"question": f"What is {i} plus 1?", "answer": f"It is {i + 1}.\n#### {i + 1}"} for i in range(300)]
    seed_dataset(home, "openai/gsm8k", "main", {"train": gsm8k, "test": gsm8k[:16]})
    seed_dataset(
        home,
        "zwhe99/DeepMath-103K",
        None,
        {
            "train": [
                {
                    "question": f"What is {i} plus {i + 1}?",
                    "final_answer": str(2 * i + 1),
                    "difficulty": 1.0,
                    "r1_solution_1": ".",
                }
                for i in range(16)
            ]
        },
    )
    seed_dataset(
        home,
        "hicai-zju/SciKnowEval",
        None,
        {
            "test": [
                {
                    "question": f"Which element has atomic number {i % 4 + 1}?",
                    "answerKey": "ABCD"[i % 4],
                    "domain": "Chemistry",
                    "choices": {"label": ["A", "B", "C", "D"], "text": ["H", "He", "Li", "Be"]},
                    "details": {"level": "L3"},
                    "type": "mcq-4-choices",
                }
                for i in range(20)
            ]
        },
    )
    hh = [
        {"chosen": f"\n\nHuman: Say {i}.\n\nAssistant: {i}", "rejected": f"\n\nHuman: Say {i}.\n\nAssistant: No."}
        for i in range(600)
    ]
    seed_dataset(home, "Anthropic/hh-rlhf", None, {"train": hh, "test": hh[:32]})
    seed_dataset(
        home,
        "Salesforce/wikitext",
        "wikitext-103-raw-v1",
        {"train": [{"text": f" The river {i} runs to the sea and the stone is blue . \n"} for i in range(400)]},
    )


def _seed_images(home: Path) -> None:
    """caltech101's columns (an image, a class label) with synthetic pictures: two classes, two of each a split."""
    import datasets
    from PIL import Image

    pictures = home / "pictures"
    pictures.mkdir()
    rows = []
    for i, colour in enumerate([(200, 40, 40), (40, 60, 200)] * 2):
        path = pictures / f"{i}.png"
        Image.new("RGB", (56 + 28 * (i % 2), 56), colour).save(path)
        rows.append({"image": str(path), "label": i % 2})
    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=["red_thing", "blue_thing"])}
    seed_dataset(home, "dpdl-benchmark/caltech101", None, {"train": rows, "test": rows}, features)


def _served_model(tiny_dir: str, out: Path) -> None:
    """The tiny Qwen2 with the special tokens the qwen3_5 renderer needs as single tokens, and a longer context."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                "<|vision_start|>",
                "<|vision_end|>",
            ]
        }
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.config.max_position_embeddings = 8192  # graders and teachers ask for up to 2048 new tokens
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _served_vision_model(out: Path) -> None:
    """A tiny Qwen2.5-VL (its image processor included) with the special tokens the qwen3_5 renderer needs."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    build_tiny_model(out, arch="qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>", "</tool_call>"]})
    model = AutoModelForImageTextToText.from_pretrained(out)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _in_hub_cache(home: Path, name: str, model_dir: Path) -> None:
    repo = home / "hub" / f"models--{name.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture(scope="module")
def cookbook_home(stack, tiny_qwen2_dir, tmp_path_factory):
    """The HF cache (models and datasets), a worker serving the SERVED names from it, and an aliased gateway."""
    home = tmp_path_factory.mktemp("cookbook-hf")
    model_dir = tmp_path_factory.mktemp("cookbook-model")
    _served_model(tiny_qwen2_dir, model_dir)
    for name in SERVED:
        _in_hub_cache(home, name, model_dir)
    vision_dir = tmp_path_factory.mktemp("cookbook-vlm")
    _served_vision_model(vision_dir)
    _in_hub_cache(home, VLM, vision_dir)
    _seed_datasets(home)
    _seed_images(home)

    env = {**stack.env(), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(home / "worker.log", "wb")
    worker = subprocess.Popen(
        [*stack.worker_command, *(f"--model={name}" for name in (*SERVED, VLM)), "--lease_ttl_s", "3"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    from treadle.queue.ops_client import OpsClient

    ops = OpsClient(stack.broker_url)
    deadline = time.monotonic() + 300
    while not {m.name for m in ops.served_models()} >= {*SERVED, VLM}:
        assert worker.poll() is None and time.monotonic() < deadline, (home / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    settings = GatewaySettings(
        port=0,
        broker_url=stack.broker_url,
        storage_url=stack.storage_url,
        api_keys={ALICE_KEY: "alice"},
        loss_alias=["stable_reinforce=cispo"],
    )
    with BackgroundGateway(settings) as gateway:
        yield home, gateway
    worker.terminate()
    worker.wait(timeout=60)
    log.close()


def _workdir(tmp_path: Path) -> Path:
    """The recipe's working directory: recipes that read `tinker_cookbook/example_data/...` relative to it find
    the cookbook's files there (as when run from a cookbook checkout), and prompt_distillation's 8 sentences."""
    example_data = tmp_path / "tinker_cookbook" / "example_data"
    shutil.copytree(str(resources.files("tinker_cookbook") / "example_data"), example_data)
    sentences = [
        "The cat is red.",
        "Le chat est rouge.",
        "El gato es rojo.",
        "Die Katze ist rot.",
        "Il gatto è rosso.",
        "O gato é vermelho.",
        "De kat is rood.",
        "Kot jest czerwony.",
    ]
    (example_data / "multilingual.txt").write_text("\n".join(sentences) + "\n")
    (tmp_path / "lang.jsonl").write_text(
        "".join(json.dumps({"messages": _chat(s, "xx")}) + "\n" for s in sentences * 2)
    )
    return tmp_path


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipe_runs_unchanged(recipe: Recipe, cookbook_home, tmp_path):
    home, gateway = cookbook_home
    cwd = _workdir(tmp_path)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",
        "TINKER_BASE_URL": gateway.url,
        "TINKER_API_KEY": ALICE_KEY,
    }
    for i, stage in enumerate(recipe.stages):
        log_path = tmp_path / f"log{i}"
        args = [a for a in stage.args if not a.startswith("log_path=")]
        if stage.metrics_rows:
            args.append(f"log_path={log_path}")
        module = (
            "tinker_cookbook.chat_app.tinker_chat_cli"
            if stage.module == "chat_app"
            else f"tinker_cookbook.recipes.{stage.module}"
        )
        run = [sys.executable, "-m", module, *args]
        done = subprocess.run(
            run, env=env, cwd=cwd, input=stage.stdin, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        if done.returncode < 0:
            # The cookbook's own process has died by a signal at interpreter shutdown after its work was done
            # (prompt distillation's data stage, its file written: SIGABRT, once SIGABRT then SIGBUS while
            # faulthandler printed a garbled thread): a crash of the client interpreter's teardown, not a treadle
            # answer, so the stage runs once more. A second death fails the test.
            print(f"{module} died by signal {-done.returncode} at exit; running it again:", done.stderr[-2000:])
            done = subprocess.run(
                run, env=env, cwd=cwd, input=stage.stdin, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        assert done.returncode == 0, f"{module} {' '.join(args)}\n" + done.stdout[-3000:] + done.stderr[-6000:]
        if stage.metrics_rows:
            rows = (log_path / "metrics.jsonl").read_text().splitlines()
            assert len(rows) >= stage.metrics_rows, rows
        _check_output(stage, done.stdout, tmp_path)


def _check_output(stage: Stage, stdout: str, home: Path) -> None:
    """What a recipe without metrics of its own must have shown."""
    if stage.module == "decisions.demo":
        answer = json.loads(stdout[stdout.index("{") : stdout.index("}") + 1])
        assert set(answer) == {"billing", "sdk", "console", "cookbook"} and abs(sum(answer.values()) - 1) < 0.01, answer
    elif stage.module == "preference.rlhf.rlhf_pipeline":
        logs = home / "tinker-runs" / "rlhf-qwen3_5_9b_base"  # the pipeline's own place (cli_utils.runs_path)
        for part in ("sft", "rm", "rl"):  # each stage trained its two steps
            assert len((logs / part / "metrics.jsonl").read_text().splitlines()) >= 2, part
    elif stage.module == "true_thinking_score.analyze":
        summaries = list((home / "tinker-runs" / "tts").glob("*/tts_summary.json"))  # its default place
        assert len(summaries) == 1, summaries
        assert json.loads(summaries[0].read_text())["n_problems_succeeded"] == 1
    elif stage.module == "vlm_classifier.train":
        runs = list((home / "vlm").glob("*/metrics.jsonl"))  # experiment_dir / the run's generated name
        assert len(runs) == 1 and len(runs[0].read_text().splitlines()) >= 2, runs
    elif stage.module == "chat_app":
        assert "Assistant" in stdout or "🤖" in stdout, stdout[-2000:]


def test_the_report_lists_every_recipe():
    assert compat_sections(COMPAT.read_text())[1] == render(), stale(COMPAT, "scripts/report_compat.py")


def render() -> str:
    import tinker_cookbook

    lines = [
        COOKBOOK_SECTION,
        "## tinker-cookbook recipes",
        "",
        "Generated by `scripts/report_compat.py` from `tests/test_cookbook_matrix.py`, which runs every recipe of "
        f"tinker-cookbook {tinker_cookbook.__version__} that runs offline, unchanged (`python -m tinker_cookbook.recipes.<name>`, "
        "public CLI options only), against the gateway for two steps on the tiny model, served under the cookbook's model "
        "names, with a few rows of each dataset in an offline Hugging Face cache. The gateway runs with "
        "`--loss_alias stable_reinforce=cispo`, so recipes whose default loss is stable_reinforce run with their defaults.",
        "",
        f"**All {len(RECIPES)} runs below work** (a failing one fails the test); "
        f"{len(NOT_RUN)} recipes are not run here, each for the reason given.",
        "",
        "| Recipe | Status | Notes |",
        "|---|---|---|",
    ]
    for recipe in RECIPES:
        modules = " then ".join(f"`{s.module}`" for s in recipe.stages)
        lines.append(f"| {recipe.name} | runs | {modules}{'; ' + recipe.note if recipe.note else ''} |")
    for name, reason in NOT_RUN.items():
        lines.append(f"| {name} | not run | {reason} |")
    return "\n".join(lines)
