"""``--backend torch``: the same tokens as ``--backend jax`` (greedy, default drafter), on a
tiny teacher and, once (slow), on the real model; the command works without torch otherwise."""

import json
import subprocess
import sys

import jax
import pytest
from test_bench import ToyRenderer

from eaglepangu_jax import runtime
from eaglepangu_jax.cli import app as cli_main
from eaglepangu_jax.drafters import registry as drafter_registry
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models import smollm2
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
PROMPT = "abcabcabc abcabc"


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    monkeypatch.setattr(runtime, "enable_compile_cache", lambda path: None)


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


@pytest.fixture
def no_eagle3(monkeypatch):
    """The shipped EAGLE-3 head is the real model's: the tiny teacher's default is ngram."""

    def missing():
        raise drafter_registry.DrafterUnavailableError("not for the tiny teacher")

    monkeypatch.setattr(methods_lib, "load_eagle3", missing)


def _generate(tmp_path, backend, argv, **inject):
    out = tmp_path / f"{backend}.json"
    status = cli_main.main(["generate", *argv, "--backend", backend, "--json", str(out)], **inject)
    assert status == 0
    return json.loads(out.read_text())


def test_generate_torch_equals_jax_on_a_tiny_teacher(teacher, tmp_path, capsys, no_eagle3):
    pytest.importorskip("torch")
    argv = [PROMPT, "--max-new-tokens", "16", "--budget", "4", "--depth", "3"]
    inject = dict(teacher=teacher, renderer=ToyRenderer())
    jax_run = _generate(tmp_path, "jax", argv, **inject)
    torch_run = _generate(tmp_path, "torch", argv, **inject)
    err = capsys.readouterr().err
    assert "drafter: ngram" in err and "backend: torch on cpu" in err
    assert (jax_run["backend"], torch_run["backend"]) == ("jax", "torch")
    assert jax_run["drafter"] == torch_run["drafter"] == "ngram"
    assert torch_run["tokens"] == jax_run["tokens"]
    assert torch_run["new_tokens"] == 16
    assert torch_run["accepted_per_round"] == jax_run["accepted_per_round"]
    assert torch_run["nodes_per_round"] == jax_run["nodes_per_round"]


def test_bench_runs_every_engine_method_through_the_torch_runner(teacher, tmp_path):
    pytest.importorskip("torch")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "one", "turns": ["abcabcabc"]}\n')
    out = tmp_path / "bench.json"
    status = cli_main.main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "greedy,ngram",
            "--max-new-tokens",
            "8",
            "--budget",
            "4",
            "--depth",
            "3",
            "--json",
            str(out),
            "--no-progress",
            "--backend",
            "torch",
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert status == 0
    report = json.loads(out.read_text())
    for name in ("greedy", "ngram"):
        assert report["methods"][name]["runner"]["backend"] == "torch"
        assert report["methods"][name]["runner"]["device"] == "cpu"
    assert "ngram" in report["methods"]["ngram"]["drafter"]
    assert report["summary"]["ngram"]["identical_fraction"] == 1.0


def test_help_works_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from eaglepangu_jax.cli.app import main\n"
        "try:\n"
        "    main(['generate', '--help'])\n"
        "except SystemExit as e:\n"
        "    sys.exit(e.code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--backend {jax,torch}" in done.stdout
    assert "npu_backend" not in done.stderr


@pytest.mark.slow  # 2-4 minutes: `make test-all` (the tiny-teacher test above runs in `make test`)
def test_generate_torch_equals_jax_on_the_real_model(tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        smollm2.find_smollm2_gguf()
    except smollm2.ModelNotInstalledError as err:
        pytest.skip(str(err))
    argv = ["What is the capital of France?", "--max-new-tokens", "32"]
    jax_run = _generate(tmp_path, "jax", argv)
    torch_run = _generate(tmp_path, "torch", argv)
    assert torch_run["drafter"] == jax_run["drafter"]  # the default: eagle3 if it loads
    assert torch_run["tokens"] == jax_run["tokens"]
    assert "Paris" in torch_run["text"]
