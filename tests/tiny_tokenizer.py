"""A small Hugging Face tokenizer built here (nothing downloaded): byte-level BPE trained to exactly
``size`` entries on seeded random words and a few English lines, with ``<|endoftext|>`` (eos, the end of
a document), ``<|im_start|>`` (bos) and ``<|im_end|>`` (pad, and the end of a chat turn), and optionally
a ChatML-style chat template whose assistant turns are marked with ``{% generation %}``; and a tiny
random Qwen3 whose vocabulary may be padded beyond it (:func:`tiny_qwen3`)."""
import random

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(directory, size=400, chat_template=None):
    """Save a ``size``-entry tokenizer to ``directory``; returns it (a PreTrainedTokenizerFast)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
             for _ in range(300)]
    text = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(40)]
    text += ["To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
             "Hello world, this is a tokenizer check: 12345.", "user assistant system"] * 10
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == size, tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|im_start|>", pad_token="<|im_end|>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return fast


def tiny_qwen3(directory, vocab, tok):
    """A random two-layer Qwen3 of ``vocab`` rows (untied head) with ``tok``'s special ids, saved to
    ``directory``; every weight perturbed so that every mapping matters."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=vocab, max_position_embeddings=128, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms start at ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(directory))
    return model.eval()
