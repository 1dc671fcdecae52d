"""The corpus n-gram table and the ngram-corpus drafter: counts equal a plain count, hashed
lookups find every row and back off, the drafter extends the n-gram drafter's tree (equal to
it without the corpus path), the engine stays lossless, files are refused when corrupt."""

import json
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_engine import CFG, NO_EOS, PROMPT, naive_greedy, teacher  # noqa: F401

from eaglepangu_jax import tree as T
from eaglepangu_jax.drafters import make_drafter, ngram_corpus, ngram_table
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.drafters.ngram_corpus import CorpusNGramDrafter, load_counted, save_counted
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig

K = ngram_table.MAX_ORDER


def plain_count(sequences, max_order=K, min_count=1):
    """{context tuple: (best next, its count, total)}, ties to the smallest id."""
    counts = defaultdict(Counter)
    for seq in sequences:
        for i in range(len(seq) - 1):
            for k in range(1, max_order + 1):
                if i - k + 1 < 0:
                    break
                counts[tuple(seq[i - k + 1 : i + 1])][seq[i + 1]] += 1
    out = {}
    for ctx, c in counts.items():
        best, n = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
        if n >= min_count:
            out[ctx] = (best, n, sum(c.values()))
    return out


def as_dict(counted):
    return {
        tuple(int(x) for x in counted.context[r][K - int(counted.order[r]) :]): (
            int(counted.next_token[r]),
            int(counted.count[r]),
            int(counted.total[r]),
        )
        for r in range(len(counted))
    }


sequences = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=14), max_size=6)


@given(sequences, st.integers(1, K), st.integers(1, 3))
def test_property_counts_equal_a_plain_count(seqs, max_order, min_count):
    counted = ngram_table.count_table(seqs, max_order=max_order, min_count=min_count)
    assert as_dict(counted) == plain_count(seqs, max_order, min_count)


def test_literal_counts_and_continuation():
    # (2, 3) is followed by 4 twice and 5 once; nothing ever follows 4 or 5.
    counted = ngram_table.count_table([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]], min_count=1)
    table = as_dict(counted)
    assert table[(2, 3)] == (4, 2, 3) and table[(1, 2, 3)] == (4, 2, 3) and table[(1,)] == (2, 3, 3)
    assert (3, 4) not in table and (4,) not in table  # no context crosses a sequence's end
    hashed = ngram_table.hash_table(counted)
    tokens, logprobs, length = ngram_table.continuation(hashed, jnp.asarray([0, 0, 0, 0, 1]), 1, 4)
    assert int(length) == 3 and tokens.tolist() == [2, 3, 4, 0]
    np.testing.assert_allclose(np.exp(logprobs[:3]), [1.0, 1.0, 2 / 3], rtol=1e-6)
    assert np.isneginf(logprobs[3])


def test_lookup_backs_off_and_respects_available():
    counted = ngram_table.count_table([[7, 8, 9], [1, 8, 3], [1, 8, 3]], min_count=1)
    hashed = ngram_table.hash_table(counted)
    # (7, 8) -> 9 is the known order-2 context; (8,) alone says 3 (twice against once).
    token, _, found = ngram_table.predict(hashed, jnp.asarray([0, 0, 5, 7, 8]), 3)
    assert bool(found) and int(token) == 9
    token, _, _ = ngram_table.predict(
        hashed, jnp.asarray([0, 0, 5, 7, 8]), 1
    )  # only the last token
    assert int(token) == 3
    token, logprob, found = ngram_table.predict(hashed, jnp.asarray([0, 0, 5, 7, 6]), 3)
    assert not bool(found) and int(token) == 0 and np.isneginf(float(logprob))


@given(st.lists(st.lists(st.integers(0, 300), min_size=2, max_size=40), min_size=1, max_size=8))
def test_property_every_kept_row_is_found(seqs):
    counted = ngram_table.count_table(seqs, min_count=1)
    hashed = ngram_table.hash_table(counted, bits=6 if len(counted) < 24 else None)
    stored = {tuple(k) for k in np.asarray(hashed.keys).tolist() if k[0] != 0}
    assert len(stored) + int(hashed.dropped) == len(counted)
    # Linear probing at most half full leaves out only rows whose neighbourhood is crowded.
    assert int(hashed.dropped) <= max(2, len(counted) // 20)
    keys = np.asarray(ngram_table.context_keys(counted.order, counted.context)).tolist()
    predict = jax.jit(ngram_table.predict)
    for r in range(len(counted)):
        if tuple(keys[r]) not in stored:
            continue
        order = int(counted.order[r])
        token, logprob, found = predict(hashed, jnp.asarray(counted.context[r]), order)
        # The longest context wins, and a row of order `order` is the longest usable one.
        assert bool(found) and int(token) == int(counted.next_token[r])
        np.testing.assert_allclose(
            float(logprob), np.log(counted.count[r] / counted.total[r]), rtol=1e-6
        )


@given(
    st.lists(st.lists(st.integers(0, 6), min_size=2, max_size=30), min_size=1, max_size=6),
    st.lists(st.integers(0, 6), min_size=K, max_size=K),
    st.integers(0, K),
    st.integers(1, 3),
)
def test_property_pruned_tables_chain_the_same_tokens(seqs, recent, available, min_count):
    counted = ngram_table.count_table(seqs, min_count=min_count)
    pruned = ngram_table.prune_redundant(counted)
    assert len(pruned) <= len(counted)
    assert set(as_dict(pruned).items()) <= set(as_dict(counted).items())
    full_table = ngram_table.hash_table(counted, bits=10)
    pruned_table = ngram_table.hash_table(pruned, bits=10)
    assert int(full_table.dropped) == int(pruned_table.dropped) == 0
    recent = jnp.asarray(recent, jnp.int32)
    a_tokens, _, a_len = ngram_table.continuation(full_table, recent, available, 6)
    b_tokens, _, b_len = ngram_table.continuation(pruned_table, recent, available, 6)
    assert a_tokens.tolist() == b_tokens.tolist() and int(a_len) == int(b_len)


def test_prune_literal():
    # (1, 2) -> 3 and (2,) -> 3: the longer row is redundant; (9, 2) -> 4 is not.
    counted = ngram_table.count_table([[1, 2, 3], [1, 2, 3], [9, 2, 4], [9, 2, 4]], min_count=1)
    kept = as_dict(ngram_table.prune_redundant(counted))
    assert (1, 2) not in kept and kept[(9, 2)] == (4, 2, 2) and kept[(2,)] == (3, 2, 4)
    assert ngram_table.prune_redundant(ngram_table.count_table([])).order.size == 0


def test_bad_counts_input():
    with pytest.raises(ValueError, match="max_order"):
        ngram_table.count_table([[1, 2]], max_order=K + 1)
    with pytest.raises(ValueError, match="min_count"):
        ngram_table.count_table([[1, 2]], min_count=0)
    with pytest.raises(ValueError, match="2\\*\\*16|65536"):
        ngram_table.count_table([[1, 70000]])
    with pytest.raises(ValueError, match="bits"):
        ngram_table.hash_table(ngram_table.count_table([[1, 2]]), bits=31)


# --- the drafter ---------------------------------------------------------------------------

TABLE = ngram_table.hash_table(
    ngram_table.count_table([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4, 5]], min_count=1)
)


def propose(drafter, table, tokens, num_tokens, start=0):
    return drafter.tree(table, jnp.asarray(tokens, jnp.int32), num_tokens, start)


def test_corpus_path_alone_scores_its_frequency():
    d = CorpusNGramDrafter(depth=4, budget=6)
    tree = propose(d, TABLE, [8, 1, 2, 0, 0], 3)  # no earlier occurrence of 2: no context match
    valid = np.asarray(tree.valid)
    assert valid.sum() == 4  # root + 3, 4, 5 (after (3, 4): 5 twice, 6 once)
    assert np.asarray(tree.tokens)[valid].tolist() == [2, 3, 4, 5]
    # A lone corpus path keeps its first token's frequency (1 here), times the depth decay.
    expected = [np.log(d.continue_prob) * k for k in range(3)]
    np.testing.assert_allclose(np.asarray(tree.logscore)[1:4], expected, rtol=1e-6)
    assert bool(T.is_valid(tree))


def test_corpus_path_joins_context_matches():
    d = CorpusNGramDrafter(depth=3, budget=6)
    # "2" occurred before, followed by 7: the context match; the corpus says 3, 4, 5.
    tree = propose(d, TABLE, [2, 7, 1, 2], 4)
    paths = {
        tuple(
            int(tree.tokens[a]) for a in np.asarray(tree.ancestors[i, 1 : int(tree.depth[i]) + 1])
        )
        for i in range(1, tree.num_slots)
        if bool(tree.valid[i])
    }
    assert (7, 1, 2) in paths and (3, 4, 5) in paths
    # The context match (weight 1) outweighs the corpus path (weight 1 * p = 1): equal here,
    # so the context match, ranked first, keeps slot 1.
    assert int(tree.tokens[1]) == 7


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 9])
def test_without_corpus_weight_it_is_the_ngram_drafter(num_tokens):
    rng = np.random.default_rng(num_tokens)
    tokens = rng.integers(0, 4, size=12)
    plain = NGramDrafter(depth=4, budget=8)
    corpus = CorpusNGramDrafter(depth=4, budget=8, corpus_weight=0.0)
    got = propose(corpus, TABLE, tokens, num_tokens)
    want = plain.tree(jnp.asarray(tokens, jnp.int32), num_tokens)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_registry_and_bad_settings():
    d = make_drafter("ngram-corpus", depth=5, budget=4)
    assert isinstance(d, CorpusNGramDrafter) and d.name == "ngram-corpus" and d.max_depth == 5
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="corpus_weight"):
            CorpusNGramDrafter(corpus_weight=bad)


PROPERTY_DRAFTER = CorpusNGramDrafter(depth=4, budget=7, num_matches=4)
_property_tree = jax.jit(PROPERTY_DRAFTER.tree)


@given(
    st.lists(st.lists(st.integers(0, 4), min_size=2, max_size=12), min_size=1, max_size=5),
    st.lists(st.integers(0, 4), min_size=16, max_size=16),
    st.integers(0, 16),
    st.sampled_from([0, 0, 2, 9]),
)
def test_property_trees_are_valid_and_scores_fall_along_paths(seqs, buf, n_tok, start):
    table = ngram_table.hash_table(ngram_table.count_table(seqs, min_count=1), bits=8)
    tree = _property_tree(table, jnp.asarray(buf, jnp.int32), n_tok, start)
    assert bool(T.is_valid(tree))
    valid = np.asarray(tree.valid)
    assert valid.sum() <= PROPERTY_DRAFTER.budget + 1
    score = np.asarray(tree.logscore)
    assert np.all(score[valid] <= score[np.asarray(tree.parents)][valid] + 1e-6)
    assert np.all(score[valid][1:] <= 1e-6)  # probabilities, never above 1


def test_engine_is_lossless_and_the_table_helps(teacher, monkeypatch):  # noqa: F811
    expected = naive_greedy(teacher, PROMPT, 24)
    # A table counted over the teacher's own continuation: its path is often right.
    table = ngram_table.hash_table(ngram_table.count_table([expected], min_count=1))
    spec = SpecConfig(budget=6, depth=3, max_new_tokens=24, eos_id=NO_EOS)
    drafter = CorpusNGramDrafter(depth=3, budget=6)
    result = gen.generate(teacher, drafter, PROMPT, spec, draft_params=table)
    assert result.tokens == expected
    # Reference mode checks every tree invariant inside the compiled step: same rounds.
    monkeypatch.setenv("EAGLEPANGU_MODE", "reference")
    checked = gen.generate(teacher, drafter, PROMPT, spec, draft_params=table)
    assert checked.tokens == expected
    assert checked.stats.accepted_per_round == result.stats.accepted_per_round
    monkeypatch.setenv("EAGLEPANGU_MODE", "performance")
    plain = gen.generate(teacher, NGramDrafter(depth=3, budget=6), PROMPT, spec)
    assert plain.tokens == expected
    assert result.stats.accepted_length > plain.stats.accepted_length


# --- files ---------------------------------------------------------------------------------


def test_table_file_round_trip_and_refusals(tmp_path):
    counted = ngram_table.count_table([[1, 2, 3, 4], [1, 2, 3, 5]], min_count=1)
    path = str(tmp_path / "table")
    save_counted(path, counted, {"teacher": "abc"})
    back, meta = load_counted(path, fingerprint="abc")
    assert as_dict(back) == as_dict(counted) and meta["rows"] == len(counted)
    with pytest.raises(ValueError, match="another teacher"):
        load_counted(path, fingerprint="xyz")
    blob = bytearray((tmp_path / "table.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (tmp_path / "table.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="sha256"):
        load_counted(path)
    meta_path = tmp_path / "table.json"
    meta_path.write_text(json.dumps({**meta, "format": "something else"}))
    with pytest.raises(ValueError, match="not an n-gram table"):
        load_counted(path)
    with pytest.raises(ValueError, match="unreadable"):
        load_counted(str(tmp_path / "missing"))


def test_a_table_of_shorter_contexts_reads_as_todays_layout(tmp_path):
    """Tables counted before contexts grew to MAX_ORDER tokens stored three context columns;
    they read back right-aligned (leading zeros) and look up the same rows."""
    counted = ngram_table.count_table([[1, 2, 3, 4], [1, 2, 3, 5]], max_order=3, min_count=1)
    narrow = ngram_table.CountedTable(
        counted.order, counted.context[:, K - 3 :], counted.next_token, counted.count, counted.total
    )
    path = str(tmp_path / "narrow")
    save_counted(path, narrow, {"teacher": "abc"})
    # A table is stored with as many context columns as its longest context: the same file.
    save_counted(str(tmp_path / "wide"), counted, {"teacher": "abc"})
    assert (tmp_path / "wide.safetensors").read_bytes() == (
        tmp_path / "narrow.safetensors"
    ).read_bytes()
    back, _ = load_counted(path)
    assert back.context.shape == (len(counted), K)
    np.testing.assert_array_equal(back.context, counted.context)
    # A narrow table whose rows claim longer contexts than its columns hold is malformed.
    bad = ngram_table.CountedTable(
        np.full_like(counted.order, 4),
        narrow.context,
        counted.next_token,
        counted.count,
        counted.total,
    )
    save_counted(path, bad, {"teacher": "abc"})
    with pytest.raises(ValueError, match="malformed"):
        load_counted(path)


def test_shipped_table_provenance():
    """The packaged table: readable, counted over the committed corpora's training answers."""
    from importlib import resources

    path = str(resources.files("eaglepangu_jax") / "weights" / ngram_corpus.SHIPPED)
    counted, meta = load_counted(path)
    assert meta["rows"] == len(counted) > 100_000
    assert meta["answer_tokens"] > 1_000_000 and meta["min_count"] == 2
    assert {c["corpus"] for c in meta["corpora"]} == {"corpus", "corpus-written", "corpus-h200"}
    for source in meta["corpora"]:
        manifest = json.loads(
            (
                resources.files("eaglepangu_jax") / "data" / source["corpus"] / "manifest.json"
            ).read_text()
        )
        train = [s["sha256"] for s in manifest["shards"] if s["split"] == "train"]
        assert source["shard_sha256"] == train  # held-out shards never counted
        assert manifest["teacher"] == meta["teacher"]


# --- the command ---------------------------------------------------------------------------


def write_corpus(folder, teacher_fp, train_answers, heldout_answers):
    """A corpus folder: one training and one held-out shard, and its manifest."""
    from eaglepangu_jax.training import corpus as corpus_lib

    shards = []
    for split, answers in (("train", train_answers), ("heldout", heldout_answers)):
        shard = corpus_lib.pack([[1]] * len(answers), answers)
        meta = corpus_lib.save_corpus_shard(folder / "answers", split, shard, {"kind": "answers"})
        shards.append({"key": split, "split": split, "sha256": meta["sha256"]})
    manifest = {"format": "eaglepangu corpus", "teacher": teacher_fp, "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_command_counts_training_answers_only(tmp_path, monkeypatch, capsys):
    from eaglepangu_jax.cli import app
    from eaglepangu_jax.models import smollm2

    monkeypatch.setattr(smollm2, "teacher_fingerprint", lambda: "f" * 64)
    write_corpus(tmp_path, "f" * 64, [[4, 5, 6], [4, 5, 6]], [[4, 5, 9], [4, 5, 9], [4, 5, 9]])
    out = tmp_path / "table"
    argv = ["--no-compile-cache", "ngram-table", "--corpus", str(tmp_path), "--out", str(out)]
    assert app.main(argv) == 0
    assert "rows" in capsys.readouterr().out
    counted, meta = load_counted(str(out), fingerprint="f" * 64)
    full = plain_count([[4, 5, 6], [4, 5, 6]], min_count=2)
    assert as_dict(counted) == full and meta["max_order"] == 3
    assert meta["answer_tokens"] == 6 and meta["corpora"][0]["train_shards"] == 1
    # --prune: (4, 5) -> 6 is what (5,) alone predicts, so it is left out.
    assert app.main(argv + ["--prune"]) == 0
    counted, meta = load_counted(str(out))
    assert as_dict(counted) == {k: v for k, v in full.items() if k != (4, 5)}
    assert meta["counted_rows"] == 3 and meta["pruned_rows"] == 1
    # Another teacher's corpus is refused by name, and nothing is written.
    write_corpus(tmp_path, "e" * 64, [[4, 5, 6]], [[4]])
    with pytest.raises(SystemExit) as stop:
        app.main(argv[:-1] + [str(tmp_path / "other")])
    assert stop.value.code == 2
    assert "another teacher" in capsys.readouterr().err
    assert not (tmp_path / "other.json").exists()
    # --max-order: contexts of at most K tokens; beyond what the drafter reads is refused.
    write_corpus(tmp_path, "f" * 64, [[4, 5, 6], [4, 5, 6]], [[4, 5, 9]])
    assert app.main(argv + ["--max-order", "1"]) == 0
    counted, meta = load_counted(str(out))
    assert set(counted.order.tolist()) == {1} and meta["max_order"] == 1
    with pytest.raises(SystemExit) as stop:
        app.main(argv + ["--max-order", str(K + 1)])
    assert stop.value.code == 2 and "--max-order must be in" in capsys.readouterr().err
