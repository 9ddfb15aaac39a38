"""scripts/bench/baselines.py: each floor checked against an independent computation on a tiny corpus built for it."""

from __future__ import annotations

import importlib.util
import math
import random
import re
import string
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pretraining.config import PROJECT_ROOT
from pretraining.data.documents import Document
from pretraining.data.manifest import PAIR_FIELDS
from pretraining.data.reader import SampleReader
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import EOS_ID, MASK_ID, SPECIAL_TOKENS, train_bpe
from pretraining.objectives.base import build_objective
from pretraining.objectives.masked_lm import IGNORE
from pretraining.train import train

BLOCKS = ["model.backbone.max_seq_len=64", "data.val_size=8", "trainer.max_steps=4"]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("baselines", PROJECT_ROOT / "scripts" / "bench" / "baselines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look up their annotations
    spec.loader.exec_module(module)
    return module


baselines = load_script()


def markov_text(rng: random.Random, successor: dict[str, str], length: int) -> str:
    """Letters where each is followed by its fixed successor 9 times in 10, else by any letter."""
    text = [rng.choice(string.ascii_lowercase)]
    for _ in range(length - 1):
        text.append(successor[text[-1]] if rng.random() < 0.9 else rng.choice(string.ascii_lowercase))
    return "".join(text)


def build(documents: list[Document], validation: list[Document], out: Path, fields: tuple[str, ...]) -> Path:
    settings = BuildSettings(validation_sources=["validation"])
    build_shards(
        documents, out, ["train"], settings, show_progress=False, fields=fields, validation_documents=validation
    )
    return out


@pytest.fixture(scope="module")
def markov_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text shards of a strong bigram structure, and a BPE tokenizer.json trained on them."""
    rng = random.Random(0)
    letters = list(string.ascii_lowercase)
    successor = dict(zip(letters, rng.sample(letters, len(letters)), strict=True))
    texts = [markov_text(rng, successor, 600) for _ in range(30)]
    train = [Document(f"train{i}", {"txt": text}) for i, text in enumerate(texts[:24])]
    validation = [Document(f"validation{i}", {"txt": text}) for i, text in enumerate(texts[24:])]
    out = build(train, validation, tmp_path_factory.mktemp("markov") / "shards", ("txt",))
    train_bpe(texts[:24], vocab_size=300, out_path=out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pairs whose query and passage share a rare byte of their own, amid words common to every pair."""
    rng = random.Random(1)
    common = ["def", "return", "self", "the", "value", "import", "for"]

    def pair(rare: str) -> dict[str, str]:
        query = " ".join([rare * 2, *rng.choices(common, k=rng.randint(3, 6))])
        passage = " ".join([rare * 2, *rng.choices(common, k=rng.randint(8, 16))])
        return dict(zip(PAIR_FIELDS, (query, passage), strict=True))

    train = [Document(f"train{i}", pair(rng.choice(string.ascii_lowercase))) for i in range(60)]
    rare = string.ascii_uppercase + string.digits + "!#$%"  # one for each validation pair, none in training
    validation = [Document(f"validation{i}", pair(byte)) for i, byte in enumerate(rare)]
    return build(train, validation, tmp_path_factory.mktemp("pairs") / "shards", PAIR_FIELDS)


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict[str, float]]:
    """The floors `main` prints: {the line's description: {metric: value}}."""
    baselines.main(list(argv))
    floors = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        name = re.split(r"\s{2,}val/", line.strip())[0]
        floors[name] = {metric: float(value) for metric, value in re.findall(r"(val/\S+)=([-\d.]+)", line)}
    return floors


def test_default_experiment_unless_one_is_named() -> None:
    assert baselines.run_config("mlm", []).model._target_.endswith("MaskedLM")
    assert baselines.run_config("contrastive", []).model._target_.endswith("Contrastive")
    assert baselines.run_config("mlm", ["experiment=clm_tiny"]).model._target_.endswith("CausalLM")


def test_bad_input_stops_with_the_message_and_no_traceback(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=rf"^baselines: data\.dir={tmp_path} holds no manifest\.json"):
        baselines.main(["clm", f"data.dir={tmp_path}"])
    with pytest.raises(SystemExit, match=r"^baselines: Could not override 'model\.nosuch'"):
        baselines.main(["clm", "model.nosuch=1"])


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_clm_unigram_is_the_hand_count(markov_dir: Path, tokenizer: str) -> None:
    cfg = baselines.run_config("clm", [f"data.dir={markov_dir}", f"tokenizer={tokenizer}", *BLOCKS])
    data = baselines.run_data(cfg)
    floors = baselines.clm_floors(cfg, data)
    assert data.tokenizer.vocab_size == (300 if tokenizer == "bpe" else 256 + len(SPECIAL_TOKENS))
    counts: Counter[int] = Counter()
    for shard in data.sources[0].manifest.shards("train"):
        for (text,) in SampleReader(["txt"]).texts(data.sources[0].manifest.url(shard)):
            counts.update([*data.tokenizer.encode(text), EOS_ID])
    total = sum(counts.values()) + data.tokenizer.vocab_size
    nll = target_bytes = targets = 0
    for block in data.validation_sets[0]:
        for token in block["tokens"][1:].tolist():
            nll -= math.log((counts[token] + 1) / total)
            target_bytes += int(data.tokenizer.token_bytes[token])
            targets += 1
    unigram = floors["unigram, add-one, counted on the whole training split"]
    assert unigram["val/bpb"] == pytest.approx(nll / (math.log(2) * target_bytes), rel=1e-9)
    assert unigram["val/loss"] == pytest.approx(nll / targets, rel=1e-9)


def test_clm_bigram_beats_unigram_on_bigram_text(markov_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    floors = printed(capsys, "clm", f"data.dir={markov_dir}", *BLOCKS)
    whole = "counted on the whole training split"
    unigram, bigram = floors[f"unigram, add-one, {whole}"], floors[f"2-gram, Witten-Bell, {whole}"]
    assert unigram["val/bpb"] > 4.5  # about log2(26): the letters are about equally frequent
    assert bigram["val/bpb"] < 1.5  # the successor 9 times in 10
    bpe = printed(capsys, "clm", f"data.dir={markov_dir}", "tokenizer=bpe", *BLOCKS)
    assert bpe[f"unigram, add-one, {whole}"]["val/bpb"] != pytest.approx(unigram["val/bpb"], rel=1e-3)


def test_clm_floors_on_the_runs_own_blocks(markov_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = [f"data.dir={markov_dir}", *BLOCKS, "trainer.max_steps=3", "data.global_batch_size=8"]
    cfg = baselines.run_config("clm", run)
    blocks = baselines.run_training_blocks(cfg, baselines.run_data(cfg))
    assert blocks.shape == (3 * 8, 64 + 1)
    accumulated = baselines.run_config("clm", [*run, "data.micro_batch_size=4"])
    assert np.array_equal(baselines.run_training_blocks(accumulated, baselines.run_data(accumulated)), blocks)
    floors = printed(capsys, "clm", *run)
    source = "counted on the run's 24 training blocks (1,536 targets)"
    assert [name for name in floors if name.endswith(source)] == [
        f"{order}, {source}"
        for order in ("unigram, add-one", "2-gram, Witten-Bell", "3-gram, Witten-Bell", "4-gram, Witten-Bell")
    ]


def probabilities_after(ngrams: baselines.NGrams, context: list[int], order: int) -> np.ndarray:
    """P(w | context) under the Witten-Bell model of `order`, for every token w of the vocabulary."""
    rows = np.array([[*context, w] for w in range(ngrams.vocab)])
    return baselines.witten_bell(ngrams, rows, order)[:, -1]


def test_witten_bell_is_a_distribution() -> None:
    tokens = np.array([5, 6, 5, 6, 5, 7, 8, 5, 6, 5, 6, 7])
    ngrams = baselines.count_ngrams(tokens[None, :], vocab=10, order=4)
    for context in ([5, 6, 5], [6, 5, 7], [8, 5, 6], [9, 9, 9], [9, 5, 6]):  # seen, once, never, partly
        for order in range(1, 5):
            assert probabilities_after(ngrams, context, order).sum() == pytest.approx(1.0)
    unigram = ngrams.unigram
    bigram = probabilities_after(ngrams, [9, 5], 2)
    assert bigram[6] == pytest.approx((4 + 2 * unigram[6]) / (5 + 2))  # 5 -> 6 four times, 5 -> 7 once
    assert probabilities_after(ngrams, [9, 9], 2)[6] == pytest.approx(unigram[6])  # 9 never seen: the unigram
    trigram = probabilities_after(ngrams, [6, 5], 3)  # 6 5 -> 6 twice, -> 7 once
    assert trigram[6] == pytest.approx((2 + 2 * bigram[6]) / (3 + 2))


def test_witten_bell_uses_no_more_history_than_the_block_holds() -> None:
    tokens = np.array([1, 2, 3, 1, 2, 4, 1, 2, 3])
    ngrams = baselines.count_ngrams(tokens[None, :], vocab=5, order=4)
    block = np.array([[1, 2, 3, 1]])
    four = baselines.witten_bell(ngrams, block, 4)
    assert four[0, 0] == baselines.witten_bell(ngrams, block, 2)[0, 0]  # one token before the first target
    assert four[0, 1] == baselines.witten_bell(ngrams, block, 3)[0, 1]  # two before the second


def de_bruijn_cycles(length: int) -> np.ndarray:
    """Repeats of 0 0 0 1 0 1 1 1: each 3 tokens say the next, and each 2 tokens leave it a coin toss."""
    return np.resize(np.array([0, 0, 0, 1, 0, 1, 1, 1]), length)


def test_a_4gram_predicts_a_periodic_text_a_3gram_cannot() -> None:
    tokens = de_bruijn_cycles(8000)
    ngrams = baselines.count_ngrams(tokens[None, :], vocab=2, order=4)
    bits = {order: -np.log2(baselines.witten_bell(ngrams, tokens[None, :], order)[0, 3:]).mean() for order in (3, 4)}
    assert bits[3] == pytest.approx(1.0, abs=0.01)
    assert bits[4] < 0.01


def test_a_higher_order_never_does_worse_on_its_own_training_text() -> None:
    rng = random.Random(2)
    letters = list(string.ascii_lowercase)
    successor = dict(zip(letters, rng.sample(letters, len(letters)), strict=True))
    rows = np.array([[ord(letter) - ord("a") for letter in markov_text(rng, successor, 500)] for _ in range(8)])
    ngrams = baselines.count_ngrams(rows, vocab=26, order=4)
    nll = [-np.log(baselines.witten_bell(ngrams, rows, order)).sum() for order in range(1, 5)]
    assert nll == sorted(nll, reverse=True)


def test_ngram_codes_must_fit_in_int64() -> None:
    with pytest.raises(SystemExit, match="does not fit"):
        baselines.count_ngrams(np.zeros((1, 8), np.int64), vocab=100_000, order=4)


def test_mlm_floors_on_the_objectives_masks(markov_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [f"data.dir={markov_dir}", *BLOCKS, "data.val_size=16"]
    cfg = baselines.run_config("mlm", overrides)
    data = baselines.run_data(cfg)
    letters = Counter(letter for (text,) in baselines.train_texts(data) for letter in text)  # a letter is a byte
    (top,) = data.tokenizer.encode(letters.most_common(1)[0][0])
    # The masks of the objective itself, validating.
    model = build_objective(OmegaConf.merge(cfg.model, {"backbone": {"d_model": 32, "n_layer": 1}}), data.format)
    batch = {
        key: torch.stack([example[key] for example in data.validation_sets[0]]) for key in data.validation_sets[0][0]
    }
    scored = model.scored_inputs(batch, validation=True)
    counted = scored.targets != IGNORE
    labels, visible = scored.targets[counted], scored.inputs.gather(1, scored.positions)[counted]
    kinds = {"mask": visible == MASK_ID, "kept": visible == labels}
    kinds["random"] = ~kinds["mask"] & ~kinds["kept"]
    assert all(selected.any() for selected in kinds.values())

    floors = printed(capsys, "mlm", *overrides)
    frequent = floors[f"most frequent token {data.tokenizer.decode([top])!r}"]
    copy = floors["copy the visible token, else the most frequent"]
    assert frequent["val/accuracy"] == pytest.approx(float((labels == top).double().mean()), abs=1e-4)
    for kind, selected in kinds.items():
        assert frequent[f"val/accuracy_{kind}"] == pytest.approx(
            float((labels[selected] == top).double().mean()), abs=1e-4
        )
    right = kinds["kept"].sum() + (kinds["mask"] & (labels == top)).sum()
    assert copy["val/accuracy"] == pytest.approx(float(right / len(labels)), abs=1e-4)
    assert copy["val/accuracy_kept"] == 1.0 and copy["val/accuracy_random"] == 0.0
    assert copy["val/accuracy_mask"] == frequent["val/accuracy_mask"]
    total = sum(letters.values()) + 256  # add-one over the byte tokens, the special ones never masked
    loss = -np.mean([math.log((letters[data.tokenizer.decode([label])] + 1) / total) for label in labels.tolist()])
    assert floors["unigram, add-one smoothed"]["val/loss"] == pytest.approx(loss, abs=1e-4)


def test_contrastive_tfidf_finds_the_shared_rare_words(pairs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["tokenizer=bytes", f"data.dir={pairs_dir}", "model.pool_size=10"]
    floors = printed(capsys, "contrastive", *overrides)
    pairs = 40
    for direction in ("q2p", "p2q"):
        tfidf = floors[f"TF-IDF (raw tf, smoothed training idf), cosine, {direction}"]
        assert tfidf[f"val/{direction}_mrr"] == 1.0 and tfidf[f"val/{direction}_mrr@10"] == 1.0
        expected = sum(1 / rank for rank in range(1, pairs + 1)) / pairs
        (random_floor,) = [
            metrics for name, metrics in floors.items() if name.startswith("random") and direction in name
        ]
        assert random_floor[f"val/{direction}_mrr"] == pytest.approx(expected, abs=0.04)
        assert random_floor[f"val/{direction}_recall@10"] == pytest.approx(10 / pairs, abs=0.06)
        assert random_floor[f"val/{direction}_mrr@10"] == pytest.approx(sum(1 / r for r in range(1, 11)) / 10, abs=0.06)
        bag = floors[f"bag of tokens, cosine, {direction}"]
        assert bag[f"val/{direction}_mrr"] < 1.0  # the common words drown the rare one without idf


def bm25_scores(queries: list[Counter], candidates: list[Counter], idf: dict[int, float], length: float) -> np.ndarray:
    """BM25 (k1 1.2, b 0.75) of every candidate for every query, summed term by term."""
    return np.array(
        [
            [
                sum(
                    count * idf[token] * doc[token] * 2.2 / (doc[token] + 1.2 * (0.25 + 0.75 * doc.total() / length))
                    for token, count in query.items()
                    if token in doc
                )
                for doc in candidates
            ]
            for query in queries
        ]
    )


def test_contrastive_bm25_is_the_term_by_term_score(pairs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["tokenizer=bytes", f"data.dir={pairs_dir}", "model.pool_size=10"]
    floors = printed(capsys, "contrastive", *overrides)
    data = baselines.run_data(baselines.run_config("contrastive", overrides))
    embedded = baselines.floor_embeddings(data)

    def bags(pairs: list[tuple[list[int], list[int]]]) -> dict[str, list[Counter]]:
        specials = len(SPECIAL_TOKENS)
        return {
            side: [Counter(token for token in pair[at] if token >= specials) for pair in pairs]
            for at, side in enumerate(("query", "passage"))
        }

    validation = bags([(pair["query"].tolist(), pair["passage"].tolist()) for pair in baselines.validation_pairs(data)])
    train = bags([(pair.query, pair.passage) for pair in data.format.examples(baselines.train_texts(data))])
    documents = train["query"] + train["passage"]
    df = Counter(token for doc in documents for token in doc)
    lucene = {t: math.log(1 + (len(documents) - df[t] + 0.5) / (df[t] + 0.5)) for t in range(data.tokenizer.vocab_size)}
    for direction, (asked, searched) in {"q2p": ("query", "passage"), "p2q": ("passage", "query")}.items():
        pool = validation[searched]
        pool_df = Counter(token for doc in pool for token in doc)
        okapi = {t: math.log((len(pool) - n + 0.5) / (n + 0.5)) for t, n in pool_df.items()}
        floor = 0.25 * np.mean(list(okapi.values()))
        okapi = {t: floor if value < 0 else value for t, value in okapi.items()}
        expected = {
            "the pool's own idf and lengths": bm25_scores(
                validation[asked], pool, okapi, np.mean([doc.total() for doc in pool])
            ),
            "training idf and lengths": bm25_scores(
                validation[asked], pool, lucene, np.mean([doc.total() for doc in train[searched]])
            ),
        }
        for statistics, scores in expected.items():
            name = f"BM25 (k1 1.2, b 0.75), {statistics}"
            (draw,) = embedded[name]
            vectors, candidates = draw[direction]
            np.testing.assert_allclose((vectors @ candidates.T).numpy(), scores, rtol=1e-9, atol=1e-12)
            mrr = np.mean([1 / (row >= row[i]).sum() for i, row in enumerate(scores)])
            assert floors[f"{name}, {direction}"][f"val/{direction}_mrr"] == pytest.approx(mrr, abs=1e-4)
        assert not np.allclose(*expected.values())  # the two statistics score differently


def test_paired_bootstrap_interval() -> None:
    rng = np.random.default_rng(3)
    floor = rng.random(400)
    model = floor + 0.05 + rng.normal(0, 0.2, 400)
    margin, low, high = baselines.paired_bootstrap(model, floor)
    assert low < margin < high
    assert margin == pytest.approx(float((model - floor).mean()))
    assert baselines.paired_bootstrap(model, floor) == (margin, low, high)  # the seed fixes it
    assert baselines.paired_bootstrap(model, floor, seed=1) != (margin, low, high)
    _, low_100, high_100 = baselines.paired_bootstrap(model[:100], floor[:100])
    assert high_100 - low_100 > 1.5 * (high - low)  # a quarter of the queries: about twice as wide
    same = baselines.paired_bootstrap(floor, floor)
    assert same == (0.0, 0.0, 0.0)  # paired: a model no better than the floor on every query


def test_model_reciprocal_ranks_are_its_validation_mrr(pairs_dir: Path) -> None:
    cfg = baselines.run_config("contrastive", ["tokenizer=bytes", f"data.dir={pairs_dir}", "model.pool_size=10"])
    data = baselines.run_data(cfg)
    model = build_objective(OmegaConf.merge(cfg.model, {"backbone": {"d_model": 32, "n_layer": 1}}), data.format)
    pairs = data.validation_sets[0][::-1]  # validation_metrics puts them in sample_id order
    batch = {key: torch.stack([pair[key] for pair in pairs]) for key in pairs[0]}
    model.eval()
    with torch.no_grad():
        logged = model.validation_metrics(model.validation_update(batch))
    embeddings = baselines.model_embeddings(model, baselines.validation_pairs(data), 7)
    ranks = baselines.reciprocal_ranks([baselines.directions(*embeddings)])
    for direction, reciprocal in ranks.items():
        assert len(reciprocal) == 40
        assert reciprocal.mean() == pytest.approx(float(logged[f"{direction}_mrr"]), abs=1e-12)


def test_a_checkpoints_margins_over_the_floors(
    pairs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["tokenizer=bytes", f"data.dir={pairs_dir}", "model.pool_size=10"]
    run = [
        *data,
        f"paths.output_dir={tmp_path}",
        f"paths.log_dir={tmp_path}/logs",
        "logger=csv",
        "model.backbone.d_model=32",
        "model.backbone.n_head=2",
        "data.global_batch_size=8",
        "data.num_workers=0",
        "model.warmup_steps=1",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
    ]
    metrics = train(baselines.run_config("contrastive", run))
    capsys.readouterr()
    baselines.main(["contrastive", *data, "--checkpoint", str(tmp_path / "checkpoints" / "last.ckpt")])
    out = capsys.readouterr().out
    model_line = re.search(r"last\.ckpt: val/q2p_mrr=([\d.]+)  val/p2q_mrr=([\d.]+)", out)
    assert model_line is not None
    assert float(model_line[1]) == pytest.approx(metrics["val/q2p_mrr"], abs=1e-4)
    assert float(model_line[2]) == pytest.approx(metrics["val/p2q_mrr"], abs=1e-4)
    margins = re.findall(
        r"(TF-IDF .*|BM25 .*|bag of .*|random.*), (q2p|p2q): ([-+][\d.]+) \(([-+][\d.]+) to ([-+][\d.]+)\)", out
    )
    assert len(margins) == 10
    for _, _, margin, low, high in margins:
        assert float(low) <= float(margin) <= float(high)
    with pytest.raises(SystemExit):
        baselines.main(["clm", "--checkpoint", "x.ckpt"])
    assert "--checkpoint is for contrastive" in capsys.readouterr().err
