"""The live next-token or masked-LM objective as an lm-evaluation-harness `LM`.

A next-token model scores as lm_eval's `HFLM` scores its Hugging Face export: the same token split of a
(context, continuation) pair (`TemplateLM`'s), the end-of-text token before an empty context, left truncation to
the context length, log-probabilities over every logit and `is_greedy` as HFLM computes them; rolling windows
from `lm_eval.utils`; greedy decoding for `generate_until`. A masked-LM model scores a continuation by its
pseudo-log-likelihood (Salazar et al. 2020): each continuation token masked in turn, with the context and the
other continuation tokens in view. lm_eval is told it runs on one rank (every rank builds every request, so every
rank computes the same score); the requests are shared out over the ranks here (`task.share`, `task.gathered`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pretraining.data.tokenizer import MASK_ID, PAD_ID, Tokenizer
from pretraining.distributed import gather
from pretraining.errors import ConfigError
from pretraining.extras.evals.task import gathered, share
from pretraining.objectives.base import frozen, uncompiled
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM

Item = TypeVar("Item")
Result = TypeVar("Result")
Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)
Scored = tuple[float, bool]  # (log-likelihood, whether greedy decoding gives it)
MAX_GEN_TOKS = 256  # HFLM's default, where a task names none


def shared_map(
    score: Callable[[list[Item]], list[Result]], items: Sequence[Item], batch_size: int, size: Callable[[Item], int]
) -> list[Result]:
    """`score` over `items` in batches, longest first (a batch pads little), shared out over the ranks: every
    rank runs as many batches and gets every result, in the order of `items`."""
    order = sorted(range(len(items)), key=lambda index: -size(items[index]))
    results = [result for batch in share([items[i] for i in order], batch_size) for result in score(batch)]
    placed: dict[int, Result] = dict(zip(order, gathered(results, len(items)), strict=True))
    return [placed[index] for index in range(len(items))]


def pair_length(pair: Pair) -> int:
    """The tokens of a (context, continuation) pair."""
    return len(pair[0]) + len(pair[1])


def right_padded(rows: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded on the right with the pad id, and where they hold tokens (batch, longest)."""
    longest = max(len(row) for row in rows)
    tokens = torch.tensor([row + [PAD_ID] * (longest - len(row)) for row in rows], device=device)
    attend = torch.tensor([[True] * len(row) + [False] * (longest - len(row)) for row in rows], device=device)
    return tokens, attend


class LiveLM(TemplateLM):
    """A `CausalLM` or `MaskedLM` objective and its run's tokenizer as an lm_eval `LM`, `batch_size` sequences
    a forward, in eval mode without gradients, on the model's device."""

    def __init__(self, model: CausalLM | MaskedLM, tokenizer: Tokenizer, batch_size: int = 16) -> None:
        super().__init__()
        self.model, self.text_tokenizer, self.batch_size = model, tokenizer, batch_size

    @property
    def eot_token_id(self) -> int:
        return self.text_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: the BOS, else the end-of-text token (as HFLM)."""
        bos = self.text_tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        """The model's context length, in tokens."""
        return self.model.backbone.max_seq_len

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        # As lm_eval's HFLM encodes with the export's tokenizer: a BOS first where its model reads one (Llama's).
        bos = self.text_tokenizer.bos_id
        tokens = [*([] if bos is None else [bos]), *self.text_tokenizer.encode(string)]
        return tokens[-left_truncate_len:] if left_truncate_len else tokens

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """The model in eval mode, without gradients, its compiled blocks run eagerly."""
        with frozen(self.model), uncompiled():
            yield

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = True) -> list[Scored]:
        with self.scoring():
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any) -> list[Scored]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        if isinstance(self.model, MaskedLM):
            return self.pseudo_log_likelihoods(pairs)
        return shared_map(self.next_token_scores, pairs, self.batch_size, pair_length)

    def next_token_scores(self, pairs: list[Pair]) -> list[Scored]:
        """Each continuation's log-likelihood after its context, and whether it is the greedy continuation."""
        inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in pairs]
        tokens, _ = right_padded(inputs, self.model.device)
        log_probs = self.model(tokens).float().log_softmax(-1)  # over every logit, as the loss and HFLM take them
        scores = []
        for row, given, (_, continuation) in zip(log_probs, inputs, pairs, strict=True):
            scored = row[len(given) - len(continuation) : len(given)]
            target = torch.tensor(continuation, device=row.device)
            greedy = bool((scored.argmax(-1) == target).all())
            scores.append((float(scored.gather(-1, target[:, None]).sum()), greedy))
        return scores

    def pseudo_log_likelihoods(self, pairs: list[Pair]) -> list[Scored]:
        """Each continuation's pseudo-log-likelihood: the sum over its tokens of log P(token) with that token
        masked; greedy when every masked token is the argmax. The masked copies are what is batched."""
        copies = []
        for context, continuation in pairs:
            if len(continuation) > self.max_length:
                raise ConfigError(
                    f"a continuation of {len(continuation)} tokens exceeds model.backbone.max_seq_len="
                    f"{self.max_length}: it cannot be scored"
                )
            tokens = (context + continuation)[-self.max_length :]
            copies += [(tokens, position) for position in range(len(tokens) - len(continuation), len(tokens))]
        scored = shared_map(self.masked_token_scores, copies, self.batch_size, lambda copy: len(copy[0]))
        results, start = [], 0
        for _, continuation in pairs:
            own = scored[start : start + len(continuation)]
            results.append((sum(score for score, _ in own), all(greedy for _, greedy in own)))
            start += len(continuation)
        return results

    def masked_token_scores(self, copies: list[tuple[list[int], int]]) -> list[Scored]:
        """log P(token) at each copy's masked position, and whether it is the argmax there."""
        rows = [[*tokens[:position], MASK_ID, *tokens[position + 1 :]] for tokens, position in copies]
        tokens, attend = right_padded(rows, self.model.device)
        positions = torch.tensor([position for _, position in copies], device=tokens.device)
        targets = torch.tensor([row[position] for row, position in copies], device=tokens.device)
        backbone = self.model.backbone
        hidden = backbone(tokens, attend)[torch.arange(len(copies), device=tokens.device), positions]
        log_probs = backbone.logits(hidden).float().log_softmax(-1)
        chosen = log_probs.gather(-1, targets[:, None])[:, 0]
        return list(zip(chosen.tolist(), (log_probs.argmax(-1) == targets).tolist(), strict=True))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = True) -> list[float]:
        """Each text's log-likelihood, over disjoint windows of the model's context (as HFLM scores it)."""
        self.refuse_masked("loglikelihood_rolling")
        windows, counts = [], []
        for (text,) in (request.args for request in requests):
            rolling = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            own = [make_disjoint_window(window) for window in rolling]
            windows += own
            counts.append(len(own))
        with self.scoring():
            scores = shared_map(self.next_token_scores, windows, self.batch_size, pair_length)
        totals, start = [], 0
        for count in counts:
            totals.append(sum(score for score, _ in scores[start : start + count]))
            start += count
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = True) -> list[str]:
        """Greedy continuations, each cut at its first stop sequence (`until`, and the end-of-text token) or after
        `max_gen_toks` tokens; the context left-truncated to leave room for them."""
        self.refuse_masked("generate_until")
        prompts = []
        for context, settings in (request.args for request in requests):
            until, max_gen_toks = self.generation_settings(settings)
            room = self.max_length - max_gen_toks
            prompts.append((self.tok_encode(context, left_truncate_len=room), until, max_gen_toks))
        with self.scoring():
            return shared_map(self.greedy_continuations, prompts, self.batch_size, lambda prompt: len(prompt[0]))

    def generation_settings(self, settings: dict[str, Any]) -> tuple[list[str], int]:
        """A request's stop sequences and most tokens to generate (HFLM's defaults), refused if they leave no
        room for a context in the model's."""
        settings = normalize_gen_kwargs(dict(settings), MAX_GEN_TOKS)
        if settings["max_gen_toks"] >= self.max_length:
            raise ConfigError(
                f"max_gen_toks={settings['max_gen_toks']} ({MAX_GEN_TOKS} where a task names none) leaves no room "
                f"for a context in model.backbone.max_seq_len={self.max_length}: give the task a smaller "
                "max_gen_toks (generation_kwargs)"
            )
        return handle_stop_sequences(settings.get("until"), eos=None), settings["max_gen_toks"]

    def greedy_continuations(self, prompts: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy decoding of a batch, one forward a token, until every row of every rank has stopped (under FSDP
        every rank takes part in every forward). Rows are padded on the right: a causal model's positions never
        see what is after them, so each row's next token is read at its own last position."""
        rows = [list(tokens) for tokens, _, _ in prompts]
        generated: list[list[int]] = [[] for _ in prompts]
        running = [True] * len(prompts)
        while any(gather(any(running))):
            tokens, _ = right_padded(rows, self.model.device)
            logits = self.model(tokens)[..., : self.model.backbone.vocab_size]
            last = torch.tensor([len(row) - 1 for row in rows], device=tokens.device)
            following = logits[torch.arange(len(rows), device=tokens.device), last].argmax(-1).tolist()
            for index, ((_, until, limit), token) in enumerate(zip(prompts, following, strict=True)):
                if running[index]:
                    rows[index].append(token)
                    generated[index].append(token)
                    text = self.text_tokenizer.decode(generated[index])
                    stopped = token == self.text_tokenizer.eos_id or any(stop and stop in text for stop in until)
                    running[index] = not stopped and len(generated[index]) < limit
        return [self.continuation_text(tokens, until) for tokens, (_, until, _) in zip(generated, prompts, strict=True)]

    def continuation_text(self, tokens: list[int], until: list[str]) -> str:
        """The generated text before the end-of-text token and before the first stop sequence."""
        eos = self.text_tokenizer.eos_id
        ended = tokens[: tokens.index(eos)] if eos in tokens else tokens
        return postprocess_generated_text(self.text_tokenizer.decode(ended), until, None)

    def refuse_masked(self, request_type: str) -> None:
        """A masked-LM model cannot score `request_type` (`HarnessTask.check` says so before training)."""
        if isinstance(self.model, MaskedLM):
            raise ConfigError(f"{request_type} needs a next-token model, and this one is a masked-LM")
