"""app.tasks: ListOps-mini against a recursive oracle, its limits and splits; the Markov source and its entropy rate."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from app import tasks

# ----------------------------------------------------------------------------- a recursive oracle, from the text


def oracle(text: str) -> int:
    """The value of an expression written as text, by recursive descent; MED as LRA: int(np.median(args))."""
    words = text.replace("]", " ] ").split()

    def parse(i):
        op = words[i]
        args, i = [], i + 1
        while words[i] != "]":
            if words[i].startswith("["):
                value, i = parse(i)
            else:
                value, i = int(words[i]), i + 1
            args.append(value)
        ops = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(statistics.median(a)), "[SM": lambda a: sum(a) % 10}
        return ops[op](args), i + 1

    value, end = parse(0)
    assert end == len(words)
    return value


HAND_WRITTEN = [
    ("[MIN 3 4 ]", 3),
    ("[MAX 3 4 ]", 4),
    ("[SM 7 8 9 ]", 4),
    ("[MED 1 4 ]", 2),  # even count: floor of the mean of the two middle values (2.5 -> 2)
    ("[MED 1 2 9 ]", 2),
    ("[MED 9 0 3 8 ]", 5),  # sorted 0 3 8 9: (3 + 8) // 2
    ("[MED 7 8 ]", 7),
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[SM [MAX 1 2 ] [MIN 5 6 ] ]", 7),
    ("[MIN [MAX [SM 9 9 ] 3 ] [MED 6 6 7 8 ] ]", 6),  # SM 9 9 = 8; MAX 8 3 = 8; MED 6 6 7 8 = 6; MIN = 6
    ("[MED [SM 5 5 ] [MAX 0 1 ] [MIN 9 8 7 ] [SM 1 1 1 ] ]", 2),  # 0 1 7 3 -> 1 3 -> 2
    ("[MAX 1 2]", 2),  # "]" right after a digit
]


@pytest.mark.parametrize("text, value", HAND_WRITTEN)
def test_the_evaluator_on_hand_written_expressions(text, value):
    assert oracle(text) == value
    assert tasks.listops_value(tasks.listops_encode(text)) == value
    assert tasks.listops_value(tasks.listops_encode(text, max_len=40)) == value  # trailing padding is ignored


def test_the_evaluator_agrees_with_the_oracle_on_generated_splits():
    splits = tasks.listops_splits(300, 50, 50, seed=3)
    for tokens, labels in splits.values():
        for row, label in zip(tokens, labels):
            assert oracle(tasks.listops_text(row)) == label == tasks.listops_value(row)


@pytest.mark.parametrize("text, message", [
    ("[MIN 3 4", r"1 expression\(s\) not closed"),
    ("[MIN 3 ] ]", "the expression ends at position 2, but 1 more"),
    ("3", "digit at position 0 outside an expression"),
    ("[MIN ]", "closes an operator without arguments"),
    ("]", "closes nothing"),
])
def test_malformed_expressions_are_refused_saying_where(text, message):
    with pytest.raises(ValueError, match=message):
        tasks.listops_value(tasks.listops_encode(text))


def test_padding_inside_an_expression_and_bad_ids_are_refused():
    with pytest.raises(ValueError, match="padding inside the expression"):
        tasks.listops_value([11, 2, 0, 3, 15])
    with pytest.raises(ValueError, match="token ids in 0..15, got 16"):
        tasks.listops_value([11, 2, 16, 15])
    with pytest.raises(ValueError, match="unknown token 'x'"):
        tasks.listops_encode("[MIN 3 x ]")


# ----------------------------------------------------------------------------- splits


@pytest.mark.parametrize("max_len, max_depth", [(128, 3), (20, 2), (12, 1)])
def test_depth_and_length_limits_hold_and_are_reached(max_len, max_depth):
    splits = tasks.listops_splits(400, 50, 50, max_len=max_len, max_depth=max_depth, seed=1)
    for tokens, labels in splits.values():
        assert tokens.shape[1] == max_len and tokens.dtype == np.int64
        depths = [tasks.listops_depth(row) for row in tokens]
        lengths = (tokens != tasks.PAD_ID).sum(axis=1)
        assert 1 <= min(depths) and max(depths) <= max_depth
        assert lengths.max() <= max_len
        # padding only trails: each row is its expression, then zeros
        assert all(np.all(row[n:] == 0) and np.all(row[:n] != 0) for row, n in zip(tokens, lengths))
    all_depths = [tasks.listops_depth(row) for tokens, _ in splits.values() for row in tokens]
    assert max(all_depths) == max_depth  # the limit is not vacuous


def test_splits_are_disjoint_deterministic_and_labelled_in_0_to_9():
    a = tasks.listops_splits(500, 100, 100, seed=7)
    b = tasks.listops_splits(500, 100, 100, seed=7)
    c = tasks.listops_splits(500, 100, 100, seed=8)
    assert all(np.array_equal(a[s][0], b[s][0]) and np.array_equal(a[s][1], b[s][1]) for s in a)
    assert not np.array_equal(a["train"][0], c["train"][0])
    assert [len(a[s][1]) for s in ("train", "val", "test")] == [500, 100, 100]
    rows = [tuple(r) for s in ("train", "val", "test") for r in a[s][0]]
    assert len(set(rows)) == len(rows)  # no expression twice, within or across splits
    labels = np.concatenate([a[s][1] for s in a])
    assert labels.dtype == np.int64 and labels.min() >= 0 and labels.max() <= 9
    assert set(labels.tolist()) == set(range(10))


def test_too_many_expressions_for_the_limits_are_refused():
    # depth 1 and 4 tokens: an operator and two digits only, 4 * 100 = 400 distinct expressions
    with pytest.raises(ValueError, match="asked for 500 distinct expressions, found 400"):
        tasks.listops_splits(300, 100, 100, max_len=4, max_depth=1, seed=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_train": 0}, "n_train: expected an integer >= 1"),
    ({"max_len": 3}, "max_len: expected an integer >= 4"),
    ({"max_depth": 0}, "max_depth: expected an integer >= 1"),
    ({"p_nest": 1.5}, r"p_nest: expected a probability in \(0, 1\]"),
    ({"seed": -1}, "seed: expected an integer >= 0"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    args = {"n_train": 5, "n_val": 5, "n_test": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        tasks.listops_splits(args.pop("n_train"), args.pop("n_val"), args.pop("n_test"), **args)


def test_class_balance_and_majority_rate():
    labels = np.array([0, 0, 0, 1, 9, 9, 2, 0])
    balance = tasks.class_balance(labels)
    assert balance.shape == (10,) and balance.sum() == 1.0
    assert balance[0] == 0.5 and balance[9] == 0.25
    assert tasks.majority_rate(labels) == 0.5
    _, train_labels = tasks.listops_splits(2000, 10, 10, seed=0)["train"]
    assert 0.1 <= tasks.majority_rate(train_labels) < 0.2  # the 10 classes are roughly balanced
    with pytest.raises(ValueError, match="labels: expected classes in 0..9"):
        tasks.majority_rate(np.array([3, 10]))


def test_token_categories():
    tokens = tasks.listops_encode("[MAX 2 [SM 4 5 ] ]", max_len=10)
    cats = tasks.token_categories(tokens[None, :])
    assert cats.shape == (1, 10)
    assert cats[0].tolist() == [2, 1, 2, 1, 1, 3, 3, 0, 0, 0]
    assert [tasks.CATEGORY_NAMES[c] for c in cats[0, :3]] == ["operator", "digit", "operator"]
    assert tasks.LISTOPS_TOKENS[0] == "<pad>" and len(tasks.LISTOPS_TOKENS) == 16


# ----------------------------------------------------------------------------- Markov source


def test_the_chain_is_sparse_stochastic_and_pi_is_stationary():
    P, pi = tasks.markov_chain(16, n_successors=3, seed=4)
    assert P.shape == (16, 16) and np.all(P[0] == 0) and np.all(P[:, 0] == 0) and pi[0] == 0
    assert np.allclose(P[1:].sum(axis=1), 1.0)
    assert np.all((P[1:] > 0).sum(axis=1) == 3)
    assert np.allclose(pi @ P, pi, atol=1e-12) and math.isclose(pi.sum(), 1.0) and np.all(pi[1:] > 0)


def test_markov_splits_are_deterministic_shifted_and_in_range():
    a = tasks.markov_splits(20, 5, 5, length=32, vocab=12, seed=2)
    b = tasks.markov_splits(20, 5, 5, length=32, vocab=12, seed=2)
    for s in a:
        tokens, targets = a[s]
        assert np.array_equal(tokens, b[s][0]) and np.array_equal(targets, b[s][1])
        assert tokens.shape == targets.shape == (len(tokens), 32)
        assert np.array_equal(targets[:, :-1], tokens[:, 1:])
        assert tokens.min() >= 1 and tokens.max() <= 11 and targets.min() >= 1
    P, _ = tasks.markov_chain(12, seed=2)
    tokens, targets = a["train"]
    assert np.all(P[tokens, targets] > 0)  # every transition is one the chain allows


def test_the_entropy_rate_is_the_monte_carlo_mean_loss_of_the_true_chain():
    """H against -mean log P[x_t, x_t+1] over sampled sequences, within 4 standard errors."""
    vocab, seed = 16, 5
    P, pi = tasks.markov_chain(vocab, seed=seed)
    H = tasks.markov_entropy_rate(vocab, seed=seed)
    tokens, targets = tasks.markov_splits(4000, 1, 1, length=16, vocab=vocab, seed=seed)["train"]
    losses = -np.log(P[tokens, targets])
    per_sequence = losses.mean(axis=1)  # sequences are independent; positions within one are not
    stderr = per_sequence.std(ddof=1) / math.sqrt(len(per_sequence))
    assert abs(per_sequence.mean() - H) < 4 * stderr
    assert 0.3 < H < math.log(3)  # at most log(n_successors)
    # the first tokens follow the stationary distribution
    freq = np.bincount(tokens[:, 0], minlength=vocab) / len(tokens)
    assert np.max(np.abs(freq - pi)) < 0.03
