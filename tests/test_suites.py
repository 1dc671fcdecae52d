"""Prompt suites: shipped suite sizes, JSONL parsing and its error messages."""

import gzip
import json

import pytest

from eaglepangu_jax.evaluation import suites


def write_lines(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_mtbench_suite():
    convs = suites.load_suite("mtbench")
    assert len(convs) == 80 and suites.count_turns(convs) == 160
    assert all(len(c.turns) == 2 for c in convs)
    assert convs[0].id == "81" and convs[0].category == "writing"
    assert convs[0].turns[1] == (
        "Rewrite your previous response. Start every sentence with the letter A."
    )
    assert len({c.id for c in convs}) == 80


def test_humaneval_suite():
    convs = suites.load_suite("humaneval")
    assert len(convs) == 80 and suites.count_turns(convs) == 80
    first, last = convs[0], convs[-1]
    assert first.id == "HumanEval/0" and last.id == "HumanEval/79"
    assert {c.category for c in convs} == {"humaneval"}
    text = first.turns[0]
    assert text.startswith("Complete the following Python function.")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in text
    assert text.endswith('"""\n```')


def test_combined_suite_has_240_turns():
    convs = suites.load_suite("mtbench-humaneval")
    assert suites.count_turns(convs) == 240
    turns = list(suites.iter_turns(convs))
    assert len(turns) == 240
    assert turns[1] == suites.Turn(
        conversation_id="81", category="writing", index=1, text=convs[0].turns[1]
    )
    assert turns[-1].conversation_id == "HumanEval/79" and turns[-1].index == 0


def test_dev_suite_is_human_written_and_disjoint_from_evaluation():
    from eaglepangu_jax.training import synth

    convs = suites.load_suite("dev")
    assert len(convs) == 56 and suites.count_turns(convs) == 104
    mtbench_categories = {c.category for c in suites.load_suite("mtbench")}
    counts = {}
    for c in convs:
        counts[c.category] = counts.get(c.category, 0) + 1
    # Six two-turn conversations in each MT-Bench category, and eight function stubs.
    assert counts == {**{c: 6 for c in mtbench_categories}, "code-completion": 8}
    assert all(len(c.turns) == (1 if c.category == "code-completion" else 2) for c in convs)
    turns = [t for c in convs for t in c.turns]
    assert len({synth.normalize(t) for t in turns}) == len(turns)
    # Model selection may look at it because the evaluation suites never share 8 words with it.
    guard = synth.EvalGuard.from_texts(suites.evaluation_texts())
    assert [t for t in turns if guard.overlaps(t)] == []
    # The check bites: an evaluation turn inside a dev turn is caught.
    assert guard.overlaps(turns[0] + " " + suites.load_suite("mtbench")[0].turns[1])


def test_written_training_prompts_stay_clear_of_every_suite():
    from eaglepangu_jax.training import synth

    convs = suites.written_prompts()
    assert len(convs) == 1011 and suites.count_turns(convs) == 1875
    assert {c.category for c in convs} == {c.category for c in suites.load_suite("dev")}
    turns = [t for c in convs for t in c.turns]
    # No near-duplicate turn (MinHash over word shingles, as the corpus's own filter).
    assert synth.deduplicate(turns) == list(range(len(turns)))
    held = suites.evaluation_texts() + [t for c in suites.load_suite("dev") for t in c.turns]
    guard = synth.EvalGuard.from_texts(held)
    assert [t for t in turns if guard.overlaps(t)] == []


def test_unknown_suite_lists_known():
    with pytest.raises(ValueError, match="known suites.*mtbench-humaneval"):
        suites.load_suite("gsm8k")


def test_load_prompts_accepts_turns_prompt_and_id_keys(tmp_path):
    path = write_lines(
        tmp_path,
        [
            json.dumps({"id": "a", "category": "chat", "turns": ["hi", "more"]}),
            "",
            json.dumps({"question_id": 7, "prompt": "one turn"}),
            json.dumps({"task_id": "T/1", "turns": ["x"]}),
        ],
    )
    convs = suites.load_prompts(path)
    assert convs == [
        suites.Conversation(id="a", category="chat", turns=("hi", "more")),
        suites.Conversation(id="7", category="general", turns=("one turn",)),
        suites.Conversation(id="T/1", category="general", turns=("x",)),
    ]


def test_load_prompts_reads_gzip(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": 1, "prompt": "p"}\n'))
    assert suites.load_prompts(path)[0].turns == ("p",)


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"id": 2}', "missing 'turns'"),
        ('{"id": 2, "turns": []}', "non-empty list"),
        ('{"id": 2, "turns": ["ok", 3]}', "non-empty list"),
        ('{"id": 2, "prompt": ["x"]}', "'prompt' must be"),
        ('{"turns": ["x"]}', "missing an id"),
        ('{"id": true, "turns": ["x"]}', "'id' must be"),
        ('{"id": 2, "turns": ["x"], "category": 5}', "'category' must be"),
        ('{"id": 1, "turns": ["again"]}', "duplicate id '1' \\(first on line 1\\)"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, problem):
    path = write_lines(tmp_path, [json.dumps({"id": 1, "turns": ["fine"]}), "", bad])
    with pytest.raises(ValueError, match=problem) as info:
        suites.load_prompts(path)
    assert f"{path}, line 3:" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="empty"):
        suites.load_prompts(path)


def test_per_category_keeps_the_first_n_of_each_category_in_order():
    convs = [
        suites.Conversation(id=str(i), category=c, turns=("x",))
        for i, c in enumerate(["a", "b", "a", "a", "c", "b"])
    ]
    assert [c.id for c in suites.per_category(convs, 1)] == ["0", "1", "4"]
    assert [c.id for c in suites.per_category(convs, 2)] == ["0", "1", "2", "4", "5"]
    suite = suites.per_category(suites.load_suite("mtbench-humaneval"), 2)
    counts = {}
    for c in suite:
        counts[c.category] = counts.get(c.category, 0) + 1
    assert len(counts) == 9 and set(counts.values()) == {2}
    with pytest.raises(ValueError, match="per-category count must be >= 1"):
        suites.per_category(convs, 0)
