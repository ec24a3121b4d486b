"""A character-level tokenizer for the built-in tiny models.

One token per character (WordLevel over single characters, split by a per-character
pre-tokenizer), wrapped as a ``transformers`` fast tokenizer so ``save_pretrained`` writes a
normal ``tokenizer.json`` that ``AutoTokenizer.from_pretrained`` and vLLM load unchanged.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
ARITHMETIC_CHARS = "0123456789+= -"


def build_char_tokenizer(
    chars: str = ARITHMETIC_CHARS, *, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """A tokenizer with ids ``<pad>=0, <s>=1, </s>=2, <unk>=3`` then one id per char of ``chars``.

    Encoding prepends BOS (post-processor); decoding fuses characters back without separators.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in {chars!r}")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S]: every single character, newline included, so characters are never merged
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    extra = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, **extra
    )
