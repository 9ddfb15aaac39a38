"""A linear probe of the frozen encoder, after validation: how linearly its features separate labels
it was never trained on.

At setup the callback builds a small labelled set from the data (`pretraining.extras.probe.labels`: by
default the function/class/method definitions of the validation split's Python files, labelled by
kind), split into train and test sides by file. After every validation (the one before training
included, so the curve starts at the untrained model) it extracts each example's features with the
objective's `features` (eval mode, no gradients: the model is not changed), fits a multinomial
logistic regression on the train side and logs its accuracy on the test side, `probe/accuracy`, with
`probe/majority`, the test side's share of its most frequent label: the accuracy of always guessing
it, which is chance. Both land in the same log row as the `val/` metrics.

Every rank extracts the features of the whole (small) set and fits the same classifier: under FSDP
every rank must take part in every forward. The loggers are rank zero's.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from pretraining.data.contract import TrainingData, training_data
from pretraining.data.tokenizer import PAD_ID
from pretraining.errors import ConfigError
from pretraining.extras.probe.labels import KEY, LabelSource, ProbeSet, label_source, probe_set


class ProbeResult(NamedTuple):
    accuracy: float  # on the test side
    majority: float  # the test side's share of its most frequent label: chance
    train_accuracy: float


def fit_linear_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    l2: float = 1e-2,
    max_iter: int = 100,
) -> ProbeResult:
    """Fit a multinomial logistic regression with an L2 penalty (`l2 / 2` times the squared weights,
    added to the mean cross-entropy) on features standardised by the train side's mean and standard
    deviation, by full-batch L-BFGS in float64 on the CPU (deterministic, at most `max_iter`
    iterations); return its accuracy on the test side."""
    with torch.inference_mode(False), torch.enable_grad():  # the caller may be in either
        x = train_x.detach().to("cpu", torch.float64, copy=True)
        mean, std = x.mean(0), x.std(0, correction=0)
        std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant feature stays 0
        x = (x - mean) / std
        x_test = (test_x.detach().to("cpu", torch.float64, copy=True) - mean) / std
        y, y_test = train_y.detach().cpu().long().clone(), test_y.detach().cpu().long().clone()
        classes = int(torch.cat([y, y_test]).max()) + 1
        weight = torch.zeros(x.shape[1], classes, dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

        def loss() -> torch.Tensor:
            optimizer.zero_grad()
            value = F.cross_entropy(x @ weight + bias, y) + l2 / 2 * weight.square().sum()
            value.backward()
            return value

        optimizer.step(loss)
        with torch.no_grad():
            train_accuracy = ((x @ weight + bias).argmax(1) == y).double().mean().item()
            accuracy = ((x_test @ weight + bias).argmax(1) == y_test).double().mean().item()
    majority = torch.bincount(y_test, minlength=classes).max().item() / len(y_test)
    return ProbeResult(accuracy, majority, train_accuracy)


class ProbeInputs(NamedTuple):
    """A probe set as token ids (unpadded) and label indices, per side."""

    train_ids: list[list[int]]
    train_y: torch.Tensor
    test_ids: list[list[int]]
    test_y: torch.Tensor


class LinearProbe(Callback):
    """After validation, fit a linear classifier on the frozen model's features of a labelled set
    and log its held-out accuracy (see the module doc).

    `labels` names the labelled examples: `kind` or `package` (`PythonDefinitions`), a `.jsonl`
    file (`LabelledJsonl`) or any `LabelSource`; `probe_set`
    keeps `max_classes`, `min_per_class` (on each side), `max_examples` and the `test_fraction`.
    Each text is encoded as the model reads its training texts (the example format's special tokens)
    and cut to `max_tokens` and to the length the model trains on (`data.format`; None: that length).
    `every_n_validations` counts the validations of this process, the first included. A set with fewer than two labels
    stops the run at setup, before any step, naming the keys to change."""

    def __init__(
        self,
        labels: str | LabelSource = "kind",
        max_classes: int = 8,
        min_per_class: int = 8,
        max_examples: int = 256,
        test_fraction: float = 0.3,
        max_tokens: int | None = None,
        batch_size: int = 64,
        every_n_validations: int = 1,
        l2: float = 1e-2,
        max_iter: int = 100,
    ) -> None:
        for key, value, minimum in [
            ("max_classes", max_classes, 2),
            ("min_per_class", min_per_class, 1),
            ("max_examples", max_examples, 4),
            ("max_tokens", 2 if max_tokens is None else max_tokens, 2),
            ("batch_size", batch_size, 1),
            ("every_n_validations", every_n_validations, 1),
            ("max_iter", max_iter, 1),
        ]:
            if value < minimum:
                raise ConfigError(f"{KEY}.{key}={value} must be at least {minimum}")
        if not 0.0 < test_fraction < 1.0 or l2 < 0:
            raise ConfigError(f"{KEY}.test_fraction={test_fraction} must be in (0, 1) and {KEY}.l2={l2} >= 0")
        self.source = label_source(labels)
        self.max_classes, self.min_per_class = max_classes, min_per_class
        self.max_examples, self.test_fraction = max_examples, test_fraction
        self.max_tokens, self.batch_size, self.every = max_tokens, batch_size, every_n_validations
        self.l2, self.max_iter = l2, max_iter
        self.inputs: ProbeInputs | None = None
        self.validations = 0
        self.latest: ProbeResult | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.inputs is None:  # once, however many validate and fit calls follow
            self.inputs = self.prepare(training_data(trainer, KEY), pl_module)

    def prepare(self, data: TrainingData, pl_module: LightningModule) -> ProbeInputs:
        """The probe set of the run's shards (its first source's), each text encoded as the model reads its
        training texts (`ExampleFormat.encode_text`), cut to the length it trains on."""
        examples = self.source(data.sources[0].manifest)
        probe = probe_set(examples, self.max_classes, self.min_per_class, self.max_examples, self.test_fraction)
        trained = min(data.format.trained_length, int(pl_module.backbone.max_seq_len))  # type: ignore[union-attr,arg-type]
        length = min(self.max_tokens or trained, trained)
        index = {label: i for i, label in enumerate(probe.classes)}
        inputs = ProbeInputs(
            [data.format.encode_text(example.text, length) for example in probe.train],
            torch.tensor([index[example.label] for example in probe.train]),
            [data.format.encode_text(example.text, length) for example in probe.test],
            torch.tensor([index[example.label] for example in probe.test]),
        )
        rank_zero_info(f"linear probe: {self.source.describe()}; {describe(probe)}, at most {length} tokens each")
        return inputs

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.inputs is None:
            return
        self.validations += 1
        if (self.validations - 1) % self.every:
            return
        start = time.perf_counter()
        inputs = self.inputs
        result = fit_linear_probe(
            extract_features(pl_module, inputs.train_ids, self.batch_size),
            inputs.train_y,
            extract_features(pl_module, inputs.test_ids, self.batch_size),
            inputs.test_y,
            self.l2,
            self.max_iter,
        )
        self.latest = result
        # The same value on every rank (each fits on the whole set): its max over ranks, so Lightning does not warn.
        probe = {"probe/accuracy": result.accuracy, "probe/majority": result.majority}
        pl_module.log_dict(probe, sync_dist=True, reduce_fx="max")
        rank_zero_info(
            f"linear probe at step {pl_module.trained_steps}: accuracy {result.accuracy:.3f} held out "
            f"(majority {result.majority:.3f}, train {result.train_accuracy:.3f}), {time.perf_counter() - start:.2f} s"
        )


def describe(probe: ProbeSet) -> str:
    counts = ", ".join(f"{label} {train}+{test}" for label, (train, test) in probe.counts.items())
    return f"{len(probe.classes)} labels (train+test: {counts}), {len(probe.train)} train / {len(probe.test)} test"


def extract_features(pl_module: LightningModule, ids: list[list[int]], batch_size: int) -> torch.Tensor:
    """`pl_module.features` of each token list (batched by length, PAD-padded), in their order, on the CPU."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    parts = []
    for start in range(0, len(order), batch_size):
        batch = [ids[i] for i in order[start : start + batch_size]]
        longest = max(len(row) for row in batch)
        tokens = torch.tensor([row + [PAD_ID] * (longest - len(row)) for row in batch], device=pl_module.device)
        attend = torch.arange(longest, device=pl_module.device) < torch.tensor(
            [len(row) for row in batch], device=pl_module.device
        ).unsqueeze(1)
        parts.append(pl_module.features(tokens, attend).cpu())  # type: ignore[operator]
    features = torch.cat(parts)
    return features[torch.argsort(torch.tensor(order))]
