"""Validation documents that are mostly training text: found by shared n-grams, and left out of the build.

A validation split that holds near-copies of training documents (generated files, vendored copies, templates
filled in twice) rewards memorising them: its loss falls faster than the model generalises, and a scaling law
fitted to it bends. Exact deduplication misses them. The rule follows PaLM's (Chowdhery et al. 2022, "Dataset
contamination": an example is contaminated when at least 70 % of its 8-grams appear in the training data), with
two differences: an 8-gram is of words and punctuation marks, so the rule does not depend on a tokenizer (trained
after the build; an unspaced run of CJK text is one word), and each distinct 8-gram counts once, however often a
document repeats it. A document of fewer than 8 words and marks is never contaminated.

Memory: 8 bytes per distinct training 8-gram, three times that while a batch of new ones is merged in, plus the
words seen and the validation documents, held until the training split is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

NGRAM = 8
WORDS_AND_MARKS = re.compile(r"\w+|[^\w\s]")
POLYNOMIAL_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: an n-gram's hash is a polynomial of its words' values
MERGE_EVERY = 1 << 22  # new 8-grams held apart before they are merged into the sorted distinct ones


def scrambled(ids: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: small consecutive word ids become 64-bit values that no short sum of
    multiples cancels, as a polynomial hash of them needs."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values (np.unique, by sorting: its default is several times slower on uint64)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


class TrainingNgrams:
    """The n-grams of the training texts added, and the share of a text's n-grams among them. Words are
    numbered in the order first read: the hashes hold within one build, which is all they are kept for."""

    def __init__(self, n: int = NGRAM) -> None:
        self.n = n
        self.word_ids: dict[str, int] = {}
        self.known = np.empty(0, dtype=np.uint64)  # sorted, distinct
        self.pending: list[np.ndarray] = []

    def ngrams(self, texts: Iterable[str]) -> np.ndarray:
        """The distinct n-gram hashes of `texts` (none spans two texts), sorted."""
        found = [np.empty(0, dtype=np.uint64)]
        for text in texts:
            words = WORDS_AND_MARKS.findall(text)
            count = len(words) - self.n + 1
            if count < 1:
                continue
            ids = scrambled(np.fromiter((self.word_ids.setdefault(w, len(self.word_ids)) for w in words), np.int64))
            hashes = np.zeros(count, dtype=np.uint64)
            for offset in range(self.n):  # wraps modulo 2**64, as a hash may
                hashes = hashes * POLYNOMIAL_BASE + ids[offset : offset + count]
            found.append(hashes)
        return distinct(np.concatenate(found))

    def add(self, texts: Iterable[str]) -> None:
        """Count `texts` as training text."""
        self.pending.append(self.ngrams(texts))
        if sum(map(len, self.pending)) >= MERGE_EVERY:
            self.merge()

    def merge(self) -> None:
        if self.pending:
            self.known = distinct(np.concatenate([self.known, *self.pending]))
            self.pending = []

    def share(self, texts: Iterable[str]) -> float:
        """The share of the distinct n-grams of `texts` found in the training texts added (0 if it has none)."""
        self.merge()
        ngrams = self.ngrams(texts)
        if len(ngrams) == 0 or len(self.known) == 0:
            return 0.0
        places = np.minimum(np.searchsorted(self.known, ngrams), len(self.known) - 1)
        return float(np.mean(self.known[places] == ngrams))
