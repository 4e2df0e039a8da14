r"""The training tasks of :mod:`app.train`, generated from a seed (no downloads).

ListOps-mini
------------
Nested expressions over four operators of digits, as in the ListOps task of
the Long Range Arena (LRA), in miniature: sequence length at most
``max_len`` (128) and nesting depth at most ``max_depth`` (3).  The
vocabulary (:data:`LISTOPS_TOKENS`) is LRA's, plus a padding token at index 0::

    0 "<pad>"   1..10 the digits "0".."9"   11 "[MIN"  12 "[MAX"  13 "[MED"  14 "[SM"   15 "]"

An expression is an operator token, two or more arguments (digits or
expressions) and ``"]"``; for example ``[MAX 2 9 [MIN 4 7 ] 0 ]`` has the
value 9.  The label is the value of the whole expression, a digit, so there
are 10 classes.  The operators:

* ``MIN``, ``MAX``: the smallest, the largest argument;
* ``MED``: the median, LRA's ``int(np.median(args))``: the middle argument
  of an odd count, and the *floor of the mean of the two middle arguments*
  of an even count (``[MED 1 4 ]`` is 2);
* ``SM`` (SUM_MOD): the sum of the arguments modulo 10.

The depth of a digit is 0 and that of an expression is one more than the
largest depth of its arguments; a sequence is one expression, of depth
1 to ``max_depth``, padded with 0 to ``max_len`` tokens.

*The distribution.*  An expression of remaining depth budget :math:`r \ge 1`
draws its operator uniformly among the four, its number of arguments
uniformly in ``2..max_args`` (5), and each argument independently: with
probability ``p_nest`` (0.25, LRA's ``VALUE_P``) and :math:`r > 1` a
sub-expression of budget :math:`r - 1`, otherwise a digit drawn uniformly.
The whole expression (budget ``max_depth``) is kept if it has at most
``max_len`` tokens and has not been drawn before; otherwise it is drawn
again (rejection).  So the sequences are i.i.d. draws of this branching
process conditioned on the length limit, without repetition.  The kept
expressions, in the order drawn, fill the training split, then the
validation split, then the test split: no expression appears twice, within
or across splits, and every split is a function of the seed alone.  (LRA
draws its root like any node and keeps only long expressions; here the
root is always an operator and short expressions are the point.)

The labels are not balanced: ``MIN`` and ``MAX`` of several digits favour
0 and 9.  :func:`class_balance` gives the class frequencies and
:func:`majority_rate` the accuracy of always answering the most frequent
class, the baseline a model has to beat.

Markov language modelling
-------------------------
Sequences from a random sparse Markov chain on the states ``1..vocab-1``
(0 is the padding token, never emitted).  From the seed,
:func:`markov_chain` draws a random cyclic permutation :math:`\sigma` of the
states (which makes the chain irreducible) and gives each state :math:`i`
the successors :math:`\{\sigma(i)\}` plus ``n_successors - 1`` further
states drawn without replacement, with Dirichlet(1) transition
probabilities :math:`P_{ij}`.  The stationary distribution :math:`\pi`
(:math:`\pi P = \pi`, unique because the chain is irreducible) starts every
sequence, so every position is distributed as :math:`\pi`.  The targets
are the next tokens: ``targets[:, t] = tokens[:, t + 1]`` of a sequence one
token longer.  A model that sees the current token can do no better, in
expected cross-entropy per token, than the entropy rate

.. math::

    H = -\sum_i \pi_i \sum_j P_{ij} \log P_{ij}\quad\text{(nats)},

(:func:`markov_entropy_rate`), since for a first-order chain the next token
is independent of the past given the current one; a causal model reaches it
at every position, including the first.

Everything is drawn with :class:`numpy.random.Generator` seeded by the
seed, so the data are the same, bit for bit, on every run.
"""

from __future__ import annotations

import numpy as np

from refimpl.validation import check_int, check_positive_float, check_seed

__all__ = [
    "LISTOPS_TOKENS",
    "PAD_ID",
    "CATEGORY_NAMES",
    "listops_splits",
    "listops_value",
    "listops_text",
    "listops_encode",
    "listops_depth",
    "token_categories",
    "class_balance",
    "majority_rate",
    "markov_chain",
    "markov_entropy_rate",
    "markov_splits",
]

#: The ListOps-mini vocabulary; index 0 is the padding token.
LISTOPS_TOKENS = ("<pad>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "[MIN", "[MAX", "[MED", "[SM", "]")
#: The padding token's index (in both tasks).
PAD_ID = 0
#: The names of the token categories of :func:`token_categories`, by category index.
CATEGORY_NAMES = ("padding", "digit", "operator", "bracket")

_DIGIT0 = 1  # token id of "0": digit d is token d + 1
_MIN, _MAX, _MED, _SM, _END = 11, 12, 13, 14, 15
_OPERATORS = (_MIN, _MAX, _MED, _SM)
# the category of each token id: 0 padding, 1 digit, 2 operator, 3 bracket
_CATEGORY_OF_TOKEN = np.array([0] + [1] * 10 + [2] * 4 + [3], dtype=np.int64)


# --------------------------------------------------------------------------- ListOps-mini


def _apply(op: int, args: list) -> int:
    """Core: the value of operator token ``op`` on the digit values ``args`` (at least one)."""
    if op == _MIN:
        return min(args)
    if op == _MAX:
        return max(args)
    if op == _SM:
        return sum(args) % 10
    ordered = sorted(args)
    half = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[half]
    # MED of an even count: LRA's int(np.median(args)), the floor of the mean of the two middle values
    return (ordered[half - 1] + ordered[half]) // 2


def listops_value(expression_tokens) -> int:
    """The value (0..9) of a ListOps-mini expression.

    Parameters
    ----------
    expression_tokens : array_like of int, shape (n,)
        Token ids (indices into :data:`LISTOPS_TOKENS`): one expression,
        optionally followed by padding (0); padding may only trail.

    Returns
    -------
    int
        The value: MIN, MAX, MED (lower-floor median of an even count, as
        LRA's ``int(np.median(...))``), SM (sum modulo 10), evaluated
        inside out.

    Raises
    ------
    ValueError
        If the tokens are not one well-formed expression (the message says
        at which position), or a token id is out of range.
    """
    tokens = _check_token_ids(expression_tokens, "expression_tokens")
    n = _unpadded_length(tokens)
    if n == 0 or np.any(tokens[:n] == PAD_ID):
        raise ValueError("expression_tokens: expected one expression followed only by padding (0), "
                         + ("got no tokens" if n == 0 else f"got padding inside the expression (first 0 at position {int(np.argmax(tokens == PAD_ID))})"))
    stack = []  # one [operator, argument values] per open expression
    for pos in range(n):
        tok = int(tokens[pos])
        if tok in _OPERATORS:
            stack.append([tok, []])
        elif tok == _END:
            if not stack or len(stack[-1][1]) < 1:
                raise ValueError(f"expression_tokens: ']' at position {pos} closes " + ("nothing" if not stack else "an operator without arguments"))
            op, args = stack.pop()
            value = _apply(op, args)
            if not stack:
                if pos != n - 1:
                    raise ValueError(f"expression_tokens: the expression ends at position {pos}, but {n - 1 - pos} more tokens follow")
                return value
            stack[-1][1].append(value)
        else:  # a digit
            if not stack:
                raise ValueError(f"expression_tokens: digit at position {pos} outside an expression (an expression starts with an operator)")
            stack[-1][1].append(tok - _DIGIT0)
    raise ValueError(f"expression_tokens: {len(stack)} expression(s) not closed with ']' at the end (position {n})")


def listops_text(tokens) -> str:
    """The expression of token ids as text, e.g. ``"[MAX 2 9 [MIN 4 7 ] 0 ]"`` (padding dropped)."""
    tokens = _check_token_ids(tokens, "tokens")
    return " ".join(LISTOPS_TOKENS[int(t)] for t in tokens[: _unpadded_length(tokens)])


def listops_encode(text: str, max_len: int | None = None) -> np.ndarray:
    """The token ids (int64) of an expression written as text, padded with 0 to ``max_len`` if given.

    Tokens are separated by white space; ``"]"`` may also follow a digit
    directly (``"[MIN 3 4]"``).
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a string, got {type(text).__name__}")
    index = {t: i for i, t in enumerate(LISTOPS_TOKENS)}
    words = text.replace("]", " ] ").split()
    unknown = [w for w in words if w not in index or w == "<pad>"]
    if unknown:
        raise ValueError(f"text: unknown token {unknown[0]!r}; expected digits, {', '.join(LISTOPS_TOKENS[11:])}")
    ids = np.array([index[w] for w in words], dtype=np.int64)
    if max_len is None:
        return ids
    max_len = check_int(max_len, "max_len", minimum=1)
    if len(ids) > max_len:
        raise ValueError(f"text: {len(ids)} tokens, more than max_len = {max_len}")
    return np.concatenate([ids, np.zeros(max_len - len(ids), dtype=np.int64)])


def listops_depth(expression_tokens) -> int:
    """The nesting depth of an expression: the largest number of operators open at once (a digit alone: 0)."""
    tokens = _check_token_ids(expression_tokens, "expression_tokens")
    opened = np.isin(tokens, _OPERATORS).astype(np.int64) - (tokens == _END)
    return int(np.max(np.cumsum(opened), initial=0))


def token_categories(tokens) -> np.ndarray:
    """The surface category of each ListOps-mini token: 0 padding, 1 digit, 2 operator, 3 bracket.

    Parameters
    ----------
    tokens : array_like of int, any shape
        Token ids (indices into :data:`LISTOPS_TOKENS`).

    Returns
    -------
    ndarray of int64, the shape of ``tokens``
        Indices into :data:`CATEGORY_NAMES`.  The operator tokens (``"[MIN"``
        ...) hold an opening bracket too; they count as operators, and
        ``"]"`` is the bracket.
    """
    tokens = _check_token_ids(tokens, "tokens", ndim=None)
    return _CATEGORY_OF_TOKEN[tokens]


class _Uniforms:
    """Uniform draws on [0, 1) from a Generator, fetched in blocks (the same stream as one draw at a time)."""

    def __init__(self, rng: np.random.Generator, block: int = 4096):
        self.rng, self.block = rng, block
        self.buffer, self.pos = rng.random(block), 0

    def next(self) -> float:
        if self.pos == self.block:
            self.buffer, self.pos = self.rng.random(self.block), 0
        self.pos += 1
        return float(self.buffer[self.pos - 1])

    def index(self, n: int) -> int:
        """A uniform draw from ``0..n-1``."""
        return min(int(self.next() * n), n - 1)


def _draw_expression(u: _Uniforms, budget: int, max_args: int, p_nest: float, out: list) -> None:
    """Core: append the token ids of one random expression of depth at most ``budget`` (>= 1) to ``out``."""
    out.append(_OPERATORS[u.index(4)])
    for _ in range(2 + u.index(max_args - 1)):
        if budget > 1 and u.next() < p_nest:
            _draw_expression(u, budget - 1, max_args, p_nest, out)
        else:
            out.append(_DIGIT0 + u.index(10))
    out.append(_END)


def listops_splits(n_train: int, n_val: int, n_test: int, *, max_len: int = 128, max_depth: int = 3, seed=0,
                   max_args: int = 5, p_nest: float = 0.25) -> dict:
    """Train, validation and test splits of ListOps-mini, disjoint, from one seed.

    Parameters
    ----------
    n_train, n_val, n_test : int
        Sizes of the splits (>= 1 each).
    max_len : int, default 128
        Tokens per sequence (>= 4): the longest expression kept and the
        padded width.
    max_depth : int, default 3
        Deepest nesting (>= 1).
    seed : int >= 0, default 0
        Seeds ``numpy.random.default_rng``; the splits are a function of
        the seed and the other arguments only.
    max_args : int, default 5
        The most arguments of one operator (>= 2); the count is uniform in
        ``2..max_args``.
    p_nest : float in (0, 1], default 0.25
        The probability that an argument is a sub-expression (while the
        depth allows one).

    Returns
    -------
    dict
        ``{"train": (tokens, labels), "val": ..., "test": ...}``: ``tokens``
        ``(n, max_len)`` int64 padded with 0, ``labels`` ``(n,)`` int64 in
        0..9.  No expression appears twice in or across the splits.

    Raises
    ------
    ValueError
        If an argument is out of range, or the limits allow fewer distinct
        expressions than asked for (found after a bounded number of draws).
    """
    sizes = {name: check_int(n, name, minimum=1) for name, n in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test))}
    max_len = check_int(max_len, "max_len", minimum=4)
    max_depth = check_int(max_depth, "max_depth", minimum=1)
    max_args = check_int(max_args, "max_args", minimum=2)
    p_nest = check_positive_float(p_nest, "p_nest")
    if p_nest > 1:
        raise ValueError(f"p_nest: expected a probability in (0, 1], got {p_nest!r}")
    seed = check_seed(seed)
    total = sum(sizes.values())
    u = _Uniforms(np.random.default_rng(seed))
    seen, kept, draws = set(), [], 0
    budget = 50 * total + 10_000  # draws before giving up: far more than the default limits need
    while len(kept) < total and draws < budget:
        draws += 1
        expression = []
        _draw_expression(u, max_depth, max_args, p_nest, expression)
        key = tuple(expression)
        if len(expression) <= max_len and key not in seen:
            seen.add(key)
            kept.append(expression)
    if len(kept) < total:
        raise ValueError(
            f"n_train + n_val + n_test: asked for {total} distinct expressions, found {len(kept)} in {draws} draws "
            f"with max_len = {max_len}, max_depth = {max_depth}, max_args = {max_args}; ask for fewer or raise the limits"
        )
    tokens = np.zeros((total, max_len), dtype=np.int64)
    labels = np.empty(total, dtype=np.int64)
    for i, expression in enumerate(kept):
        tokens[i, : len(expression)] = expression
        labels[i] = listops_value(tokens[i])
    edges = np.cumsum([0, sizes["n_train"], sizes["n_val"], sizes["n_test"]])
    return {name: (tokens[a:b], labels[a:b]) for name, a, b in zip(("train", "val", "test"), edges[:-1], edges[1:])}


def class_balance(labels, n_classes: int = 10) -> np.ndarray:
    """The frequency of each class ``0..n_classes-1`` among ``labels`` (sums to 1)."""
    labels = _check_labels(labels, n_classes)
    return np.bincount(labels, minlength=n_classes) / labels.size


def majority_rate(labels, n_classes: int = 10) -> float:
    """The accuracy of always answering the most frequent class of ``labels``: the largest class frequency."""
    return float(np.max(class_balance(labels, n_classes)))


# --------------------------------------------------------------------------- Markov language modelling


def markov_chain(vocab: int = 16, *, n_successors: int = 3, seed=0) -> tuple:
    """The random sparse Markov chain of :func:`markov_splits`: transition matrix and stationary distribution.

    Parameters
    ----------
    vocab : int, default 16
        Vocabulary size, padding included (>= 3): the states are ``1..vocab-1``.
    n_successors : int, default 3
        Successors of each state (``1..vocab-1``), one of them on a random
        cycle through all states.
    seed : int >= 0, default 0

    Returns
    -------
    transition : ndarray, shape (vocab, vocab)
        Row ``i`` is the distribution of the token after ``i``; row and
        column 0 (padding) are zero.
    stationary : ndarray, shape (vocab,)
        :math:`\\pi` with :math:`\\pi P = \\pi`, :math:`\\sum\\pi = 1`, :math:`\\pi_0 = 0`.
    """
    vocab = check_int(vocab, "vocab", minimum=3)
    n_successors = check_int(n_successors, "n_successors", minimum=1)
    if n_successors > vocab - 1:
        raise ValueError(f"n_successors: expected at most vocab - 1 = {vocab - 1}, got {n_successors}")
    seed = check_int(seed, "seed", minimum=0)  # an int: it is combined with a stream number, default_rng([seed, k])
    return _markov_chain(vocab, n_successors, np.random.default_rng([seed, 1]))


def _markov_chain(vocab: int, n_successors: int, rng: np.random.Generator) -> tuple:
    """Core of :func:`markov_chain`."""
    states = np.arange(1, vocab)
    S = vocab - 1
    cycle = rng.permutation(states)
    successor = np.empty(vocab, dtype=np.int64)
    successor[cycle] = np.roll(cycle, -1)  # sigma: each state to the next one on the cycle
    P = np.zeros((vocab, vocab))
    for i in states:
        others = states[states != successor[i]]
        support = np.concatenate([[successor[i]], rng.choice(others, n_successors - 1, replace=False)])
        P[i, support] = rng.dirichlet(np.ones(n_successors))
    # pi P = pi with sum(pi) = 1: the (unique, irreducible chain) solution of the stacked linear system
    A = np.vstack([P[1:, 1:].T - np.eye(S), np.ones((1, S))])
    b = np.concatenate([np.zeros(S), [1.0]])
    pi = np.zeros(vocab)
    pi[1:] = np.linalg.lstsq(A, b, rcond=None)[0]
    return P, pi


def markov_entropy_rate(vocab: int = 16, *, n_successors: int = 3, seed=0) -> float:
    """The entropy rate (nats per token) of :func:`markov_chain`: the lowest expected next-token loss.

    :math:`H = -\\sum_i \\pi_i \\sum_j P_{ij}\\log P_{ij}`, the conditional
    entropy of the next token given the current one under the stationary
    distribution, which starts every sequence of :func:`markov_splits`.
    """
    P, pi = markov_chain(vocab, n_successors=n_successors, seed=seed)
    # 0 log 0 = 0: only the successors contribute
    plogp = np.where(P > 0, P * np.log(np.where(P > 0, P, 1.0)), 0.0)
    return float(-np.sum(pi[:, None] * plogp))


def markov_splits(n_train: int, n_val: int, n_test: int, *, length: int = 64, vocab: int = 16, n_successors: int = 3,
                  seed=0) -> dict:
    """Train, validation and test sequences of the Markov chain of :func:`markov_chain` (same seed).

    Parameters
    ----------
    n_train, n_val, n_test : int
        Sequences per split (>= 1 each).
    length : int, default 64
        Tokens per sequence (>= 1).
    vocab : int, default 16
        Vocabulary size, padding (0, never emitted) included.
    n_successors : int, default 3
    seed : int >= 0, default 0

    Returns
    -------
    dict
        ``{"train": (tokens, targets), "val": ..., "test": ...}``, both
        ``(n, length)`` int64 in ``1..vocab-1``; ``targets[:, t]`` is the
        token after ``tokens[:, t]`` (``targets[:, :-1] == tokens[:, 1:]``).
        The first token is drawn from the stationary distribution.
    """
    sizes = [check_int(n, name, minimum=1) for name, n in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test))]
    length = check_int(length, "length", minimum=1)
    P, pi = markov_chain(vocab, n_successors=n_successors, seed=seed)
    rng = np.random.default_rng([seed, 2])
    total = sum(sizes)
    seq = np.empty((total, length + 1), dtype=np.int64)
    cum_pi = np.cumsum(pi)
    cum = np.cumsum(P, axis=1)
    # inverse-CDF sampling: the first index whose cumulative probability exceeds u * (row total)
    seq[:, 0] = np.sum(cum_pi[None, :] <= rng.random(total)[:, None] * cum_pi[-1], axis=1)
    for t in range(length):
        rows = cum[seq[:, t]]
        seq[:, t + 1] = np.sum(rows <= rng.random(total)[:, None] * rows[:, -1:], axis=1)
    edges = np.cumsum([0] + sizes)
    return {name: (seq[a:b, :-1], seq[a:b, 1:]) for name, a, b in zip(("train", "val", "test"), edges[:-1], edges[1:])}


# --------------------------------------------------------------------------- checks


def _check_token_ids(tokens, name: str, ndim: int | None = 1) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name}: expected integer token ids, got {arr.dtype} values")
    arr = arr.astype(np.int64, copy=False)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape} ({arr.ndim}-D)")
    if arr.size and (arr.min() < 0 or arr.max() >= len(LISTOPS_TOKENS)):
        bad = arr[(arr < 0) | (arr >= len(LISTOPS_TOKENS))].flat[0]
        raise ValueError(f"{name}: expected token ids in 0..{len(LISTOPS_TOKENS) - 1}, got {bad}")
    return arr


def _check_labels(labels, n_classes: int) -> np.ndarray:
    n_classes = check_int(n_classes, "n_classes", minimum=1)
    arr = np.asarray(labels)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"labels: expected a non-empty 1-D array of integer class labels, got {arr.dtype} of shape {arr.shape}")
    if arr.min() < 0 or arr.max() >= n_classes:
        raise ValueError(f"labels: expected classes in 0..{n_classes - 1}, got values from {arr.min()} to {arr.max()}")
    return arr.astype(np.int64, copy=False)


def _unpadded_length(tokens: np.ndarray) -> int:
    """Core: the length of a 1-D token sequence without its trailing padding."""
    nonpad = np.flatnonzero(tokens != PAD_ID)
    return int(nonpad[-1]) + 1 if nonpad.size else 0
