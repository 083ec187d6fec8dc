"""A local word-level tokenizer + saved tiny ModernBERT, so ST / PyLate tests run offline."""

from __future__ import annotations

WORDS = ("the a of to in and is was for on with as by at from that it an be this which or are were has "
         "search query document encoder packed padding token attention window model text retrieval vector "
         "late interaction colbert modern bert layer norm rotary gelu fast slow short long river city music "
         "history science water energy light cell protein planet star ocean mountain forest language").split()

TEXTS = [
    "the search query", "a long document about the history of music and the city by the river",
    "what is packed attention", "modern bert encoder with rotary layer norm and gelu " * 6,
    "short", "late interaction retrieval with colbert vector " * 12,
    "the planet and the star in the ocean of light", "protein cell energy water " * 30,
]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, "[MASK]": 4}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                   unk_token="[UNK]", mask_token="[MASK]", model_max_length=512,
                                   model_input_names=["input_ids", "attention_mask"])


def save_tiny_model(path, seed: int = 0, **config_overrides):
    """Save a tiny random ModernBERT + the tokenizer to ``path`` and return ``path``."""
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=2, intermediate_size=96,
              num_hidden_layers=3, local_attention=8, pad_token_id=0, cls_token_id=1, sep_token_id=2,
              bos_token_id=1, eos_token_id=2)
    kw.update(config_overrides)
    model = ModernBertModel(ModernBertConfig(**kw))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
