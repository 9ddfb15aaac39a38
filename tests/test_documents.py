"""Document-aware attention over packed blocks: `model.document_masking` and `model.document_positions`."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pretraining.data.tokenizer import EOS_ID
from pretraining.errors import ConfigError
from pretraining.models.attention import document_block_mask, document_positions
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.run import check_config
from pretraining.train import train

VOCAB = 50
adamw = partial(torch.optim.AdamW, lr=1e-2)


def backbone(causal: bool, positions: str = "learned") -> Transformer:
    torch.manual_seed(0)
    shape = {"max_seq_len": 512, "d_model": 32, "n_layer": 2, "n_head": 2}
    return Transformer(vocab_size=VOCAB, **shape, causal=causal, positions=positions).eval()


def packed(*lengths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of documents of these lengths, each ending in EOS, and each token's document."""
    documents = torch.cat([torch.full((length,), number) for number, length in enumerate(lengths)])
    tokens = torch.randint(4, VOCAB, (len(documents),))
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[ends] = EOS_ID
    return tokens[None], documents[None]


def test_positions_restart_at_each_document() -> None:
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_document_reads_as_if_it_were_alone(causal: bool, positions: str) -> None:
    """With the mask and restarted positions, each document's hidden states in a packed row equal those
    of the document read on its own; without them, a token of one document changes the next one's."""
    model = backbone(causal, positions)
    tokens, documents = packed(7, 12, 5)
    masked = model(tokens, documents=documents, position_ids=document_positions(documents))
    for number, (start, end) in enumerate([(0, 7), (7, 19), (19, 24)]):
        alone = model(tokens[:, start:end])
        assert torch.allclose(masked[:, start:end], alone, atol=1e-5), number

    changed = tokens.clone()
    changed[0, 3] = 4 if tokens[0, 3] != 4 else 5  # a token of the first document
    again = model(changed, documents=documents)
    assert torch.allclose(again[:, 7:], model(tokens, documents=documents)[:, 7:], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 7:], model(tokens)[:, 7:], atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_the_block_mask_allows_what_the_boolean_mask_allows(causal: bool) -> None:
    """The CUDA path's FlexAttention block mask against the SDPA mask of the CPU path (FlexAttention runs
    forward on the CPU too, uncompiled)."""
    model = backbone(causal)
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 32])
    query, key, value = torch.randn(3, 2, 2, 32, 16).unbind(0)
    boolean = model.attention_mask(None, documents)
    assert isinstance(boolean, torch.Tensor) and boolean.shape == (2, 1, 32, 32)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=boolean)
    with torch.no_grad():
        flex = flex_attention(query, key, value, block_mask=document_block_mask(documents, causal))
    assert torch.allclose(flex, expected, atol=1e-5)


def test_padding_and_documents_combine() -> None:
    model = backbone(causal=False)
    attend = torch.tensor([[True, True, True, False]])
    documents = torch.tensor([[0, 0, 1, 1]])
    mask = model.attention_mask(attend, documents)
    assert isinstance(mask, torch.Tensor)
    assert mask[0, 0].tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, True, False],
    ]
    assert model.attention_mask(None, None) is None


@pytest.mark.parametrize("objective", [CausalLM, MaskedLM])
def test_the_objectives_read_documents_only_when_asked(objective: type) -> None:
    tokens, documents = packed(9, 14, 10)
    batch = {"tokens": tokens, "doc_ids": documents, "sample_id": torch.arange(1)}
    losses = {}
    for masking in (False, True):
        model = objective(backbone(objective is CausalLM), optimizer=adamw, document_masking=masking)
        losses[masking] = model.training_loss(batch).item()
    assert losses[True] != pytest.approx(losses[False], rel=1e-6)
    plain = objective(backbone(objective is CausalLM), optimizer=adamw)
    assert plain.training_loss({k: v for k, v in batch.items() if k != "doc_ids"}).item() == losses[False]


def test_pairs_have_no_documents_to_mask(compose_train) -> None:
    cfg = compose_train("+model.document_masking=true", experiment="contrastive_tiny")
    with pytest.raises(ConfigError, match=r"model\.document_masking is not a parameter of .*\.Contrastive"):
        check_config(cfg)


@pytest.mark.parametrize("experiment", ["clm_tiny", "mlm_tiny"])
def test_a_run_masks_documents_from_the_datas_boundaries(compose_train, tmp_path, monkeypatch, experiment: str) -> None:
    """Through Hydra, the DataModule and the Trainer, the backbone receives the data's document boundaries
    (blocks holding two documents among them) and positions restarting at each; without the keys, neither."""
    seen: dict[str, list] = {"documents": [], "position_ids": []}
    forward = Transformer.forward

    def spy(self, tokens, attend=None, documents=None, position_ids=None):  # type: ignore[no-untyped-def]
        seen["documents"].append(documents)
        seen["position_ids"].append(position_ids)
        return forward(self, tokens, attend, documents, position_ids)

    monkeypatch.setattr(Transformer, "forward", spy)
    for masking in ("false", "true"):
        seen["documents"].clear(), seen["position_ids"].clear()
        keys = [f"model.document_masking={masking}", f"model.document_positions={masking}"]
        out = f"paths.output_dir={tmp_path / masking}"  # two runs, not one continued
        train(compose_train(*keys, out, "trainer.max_steps=6", "~callbacks.text_sample", experiment=experiment))
        packed = [(d, p) for d, p in zip(seen["documents"], seen["position_ids"], strict=True) if d is not None]
        if masking == "false":
            assert not packed and all(p is None for p in seen["position_ids"])
            continue
        assert packed and any(int(documents.max()) > 0 for documents, _ in packed)  # boundaries inside blocks
        for documents, position_ids in packed:
            assert torch.equal(position_ids, document_positions(documents))


def test_the_document_keys_need_the_batches_documents() -> None:
    model = CausalLM(backbone(causal=True), optimizer=adamw, document_masking=True)
    tokens, _ = packed(9, 14)
    with pytest.raises(ConfigError, match=r"need each batch's doc_ids.*leave both false"):
        model.training_loss({"tokens": tokens})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("causal", [True, False])
def test_on_cuda_flex_attention_trains_as_the_boolean_mask_does(causal: bool) -> None:
    """The CUDA path (compiled FlexAttention, block-sparse) against the CPU path (SDPA with a boolean
    mask): the same hidden states and gradients, in float32."""
    model = backbone(causal).train()
    tokens, documents = packed(70, 300, 1, 141)
    on_cuda = copy.deepcopy(model).cuda()
    assert isinstance(on_cuda.attention_mask(None, documents.cuda()), BlockMask)
    hidden = {}
    for name, module, device in (("cpu", model, "cpu"), ("cuda", on_cuda, "cuda")):
        output = module(tokens.to(device), documents=documents.to(device))
        output.square().mean().backward()
        hidden[name] = output.detach().cpu()
    torch.testing.assert_close(hidden["cuda"], hidden["cpu"], atol=2e-4, rtol=2e-4)
    for (name, cpu), cuda in zip(model.named_parameters(), on_cuda.parameters(), strict=True):
        torch.testing.assert_close(cuda.grad.cpu(), cpu.grad, atol=2e-4, rtol=2e-3, msg=name)
