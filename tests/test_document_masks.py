"""Packed documents (Megatron-LM's --reset-attention-mask, --reset-position-ids, --eod-mask-loss): each
document of a packed sequence trains exactly as it would alone, under every layout."""
import pytest
import torch

from megazero.config import ConfigError, config_from_dict, parse_args, validate
from megazero.data import build_data, micro_batches
from megazero.data.documents import document_ids, document_mask, document_positions
from megazero.process.local_ranks import run_ranks
from models import build_model
from oracle_models import FAMILIES, family_cfg
from tolerance import R_TRAIN

FLAGS = dict(tokenizer_type="NullTokenizer", reset_attention_mask=True, reset_position_ids=True,
             eod_mask_loss=True)


def test_documents_follow_megatrons_rule():
    """The EOD token ends its document; the next token is position 0 of the next one.  A row without
    EOD (a document longer than the sequence) is one document at positions 0 .. s - 1."""
    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, eod, eod, 4, 5],
                           [1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, eod).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert document_positions(tokens, eod).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    seen = document_mask(document_ids(tokens, eod), None, torch.float64)[0, 0] == 0
    assert seen[3].tolist() == [False, False, False, True, False, False, False, False]
    assert seen[7].tolist() == [False] * 6 + [True, True]
    windowed = document_mask(document_ids(tokens, eod), 1, torch.float64)[1, 0] == 0
    assert windowed[5].tolist() == [False] * 4 + [True, True, False, False]


def _cfg(family, **extra):
    return validate(family_cfg(family, **FLAGS, **extra), 1)


# a 16-token packed sequence (17 ids: inputs and labels) of four documents, EODs at 4, 5 and 11: the
# second is the EOD alone; the last runs to the end of the sequence
ENDS = (4, 5, 11)


def _packed(eod: int) -> torch.Tensor:
    ids = (torch.arange(17) * 7 + 3) % eod  # never eod
    ids[list(ENDS)] = eod
    return ids


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-12):
    """``|got - want| <= rel * max|want|`` everywhere (float64: the summation order alone differs)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, scale = float((got - want).detach().abs().max()), float(want.detach().abs().max())
    assert err <= rel * scale, f"{what}: off by {err:.3g}, {err / max(scale, 1e-300):.3g} of the largest"


def _per_token_and_grads(model, ids: torch.Tensor, mask=None):
    model.zero_grad()
    loss = model(ids[None, :-1], labels=ids[None, 1:])[0]
    (loss * (mask if mask is not None else 1.0)).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma2"])
def test_each_packed_document_trains_as_it_would_alone(family):
    """float64: the packed sequence's per-token losses and parameter gradients equal those of its
    documents run one by one (learned or rotary positions, windows, a layer without RoPE, soft-capped
    scores), to 1e-12 of the largest value."""
    extra = dict(attn_logit_softcapping=2.0) if family == "gemma2" else {}
    cfg = _cfg(family, **extra)
    eod = cfg.model.vocab_size - 1  # NullTokenizer's
    model = build_model(cfg).double()
    ids = _packed(eod)
    mask = (ids[:-1] != eod).double()  # --eod-mask-loss: no prediction from an EOD input
    packed, packed_grads = _per_token_and_grads(model, ids, mask)
    starts = (0,) + tuple(e + 1 for e in ENDS)
    ends = ENDS + (16,)
    alone_grads = {n: torch.zeros_like(g) for n, g in packed_grads.items()}
    for start, end in zip(starts, ends):
        if end == start:  # the EOD alone predicts nothing of its own document
            continue
        loss, grads = _per_token_and_grads(model, ids[start:end + 1])
        _assert_close(packed[start:end], loss, f"losses of tokens {start}..{end - 1}")
        for n, g in grads.items():
            alone_grads[n] += g
    for n, g in packed_grads.items():
        _assert_close(g, alone_grads[n], f"gradient of {n}")


def test_without_the_flags_documents_see_each_other():
    """The check above has teeth: without --reset-attention-mask the second document's losses move."""
    cfg = validate(family_cfg("llama", tokenizer_type="NullTokenizer"), 1)
    model = build_model(cfg).double()
    ids = _packed(cfg.model.vocab_size - 1)
    packed, _ = _per_token_and_grads(model, ids)
    alone, _ = _per_token_and_grads(model, ids[6:12])
    assert (packed[6:11] - alone).abs().max() > 1e-6


def test_eod_mask_loss_with_mock_data_masks_the_eod_inputs():
    """--eod-mask-loss on --mock-data with a NullTokenizer: the mask is 0 exactly where the input is the
    EOD id (--vocab-size), with or without the reset flags."""
    for flags in (dict(tokenizer_type="NullTokenizer", eod_mask_loss=True), FLAGS):
        cfg = validate(config_from_dict(dict(mock_data=True, vocab_size=16, seq_length=32, **flags)), 1)
        (mb,) = micro_batches(build_data(cfg), 0, 1, 1)
        eod = cfg.model.vocab_size - 1
        assert (mb["tokens"] == eod).any()
        assert torch.equal(mb["loss_mask"], (mb["tokens"] != eod).float())


@pytest.mark.parametrize("flag", ["--reset-attention-mask", "--reset-position-ids"])
def test_flags_without_an_eod_id_are_refused(flag):
    with pytest.raises(ConfigError, match=f"{flag} needs an end-of-document id: give --tokenizer-model"):
        parse_args(["--mock-data", flag])
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", flag])
    assert cfg.data.reset_attention_mask == (flag == "--reset-attention-mask")


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (3, 2.0)])
def test_the_blockwise_kernel_keeps_documents_apart(window, softcap):
    """The kernel of context parallelism (tiles of 4 over 23 tokens, grouped-query heads) with document
    ids equals softmax over the dense document mask, output and gradients, in float64."""
    from megazero.context_parallel import blockwise_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 23, 8, dtype=torch.float64, generator=gen).requires_grad_()
               for heads in (4, 2, 2))
    docs = document_ids(torch.randint(0, 5, (2, 23), generator=gen), 4)
    out, _ = blockwise_attention(q, k, v, block_size=4, window=window, softcap=softcap, q_documents=docs,
                                 k_documents=docs)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8 ** 0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    want = (scores + document_mask(docs, window, torch.float64)).softmax(-1) @ v.repeat_interleave(2, 1)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    _assert_close(out, want, "output")
    grads = []
    for result in (out, want):  # backward, not autograd.grad (whose first call here took a second)
        result.backward(grad)
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for name, a, b in zip("qkv", *grads):
        _assert_close(a, b, f"d{name}", rel=1e-13)


# ---- the trainer under TP 2 x PP 2 against one process ----------------------------------------------
def _train_history(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _train_cfg(tp=1, pp=1, **extra):
    """A tiny LLaMA on mock data; NullTokenizer: ids 0 .. 16, of which 16 ends documents (about one in 9)."""
    settings = dict(mock_data=True, num_layers=4,
                    hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                    vocab_size=16, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    global_batch_size=8, micro_batch_size=1, train_iters=3, eval_interval=2, eval_iters=1,
                    optimizer="sgd", lr=0.1, log_interval=100, hidden_dropout=0.0, attention_dropout=0.0,
                    position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                    add_bias_linear=False, ffn_hidden_size=48, **FLAGS)
    return config_from_dict(dict(settings, **extra))


WINDOW = dict(window_size=[5, 0], window_attn_skip_freq=2, untie_embeddings_and_output_weights=True)
MOE = dict(FAMILIES["moe"], num_layers=4, moe_layer_freq="([0]*1+[1]*1)*2")
LAYOUTS = {  # name: (model, layout) on 4 ranks
    "tp2-pp2-window": (WINDOW, dict(tp=2, pp=2)),
    "tp2-sp-pp2-moe": (MOE, dict(tp=2, pp=2, sequence_parallel=True)),
    "tp2-sp-pp2-learned-positions": (dict(position_embedding_type="learned_absolute"),
                                     dict(tp=2, pp=2, sequence_parallel=True)),
    "pp2x2virtual-dp2-zero2-recompute-window": (WINDOW, dict(pp=2, zero_stage=2, recompute_granularity="full",
                                                             num_layers_per_virtual_pipeline_stage=1)),
    # context parallelism: ring attention (p2p) and Ulysses (a2a) compare every CP rank's document ids
    "cp2-tp2-sp-p2p-window": (WINDOW, dict(tp=2, context_parallel_size=2, sequence_parallel=True)),
    "cp4-a2a-learned-positions": (dict(position_embedding_type="learned_absolute"),
                                  dict(context_parallel_size=4, cp_comm_type="a2a")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_documents_under_a_layout_match_one_process(name):
    """TP 2 x PP 2 (sequence parallel with MoE or learned positions), PP 2 with virtual stages x DP 2
    with ZeRO-2 and full recomputation, CP 2 x TP 2 (ring) or CP 4 (Ulysses): the later pipeline
    chunks find the documents in the micro-batch's tokens, the CP ranks compare each other's
    document ids; losses, gradient norms and evaluation equal one process's."""
    model, layout = LAYOUTS[name]
    (ref,) = run_ranks(_train_history, 1, _train_cfg(**model))
    got = run_ranks(_train_history, 4, _train_cfg(**model, **layout))[0]
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got if key in m]
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key
    off = dict(reset_attention_mask=False, reset_position_ids=False)
    (plain,) = run_ranks(_train_history, 1, _train_cfg(**model, **off))
    assert [m["loss"] for m in plain] != pytest.approx([m["loss"] for m in ref], rel=1e-4)


def test_blockwise_skips_tile_pairs_across_documents():
    """Ids on the host: a pair whose keys' documents all end before its queries' is skipped, so 8
    documents of one tile each leave the 8 diagonal pairs of the 36 causal ones; a row whose documents
    differ keeps its pairs (every row must allow the skip)."""
    from megazero.context_parallel.blockwise import Tiles, Visibility, document_kinds, tile_pairs
    s, block = 64, 8
    positions = torch.arange(s)
    docs = (positions // block).expand(2, s)  # eight documents of one tile, both rows
    tiles = Tiles(positions, block, "cpu", docs)
    assert tile_pairs(tiles, tiles, Visibility()) == 8
    assert tile_pairs(Tiles(positions, block, "cpu"), Tiles(positions, block, "cpu"), Visibility()) == 36
    one_long = torch.stack([positions // block, torch.zeros(s, dtype=torch.long)])  # row 1: one document
    tiles = Tiles(positions, block, "cpu", one_long)
    assert tile_pairs(tiles, tiles, Visibility()) == 36
    kinds = document_kinds(Tiles(positions, block, "cpu", docs), Tiles(positions, block, "cpu", docs))
    assert kinds[3][3] == 1 and kinds[3][2] == 0  # FULL on the diagonal (no comparison), SKIP below
