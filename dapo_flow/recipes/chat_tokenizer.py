"""A byte-level BPE chat tokenizer built like Qwen2's, trained locally with ``tokenizers``.

What it shares with Qwen2's (so every code path a real model takes is taken here): byte-level
BPE over Qwen2's pre-tokenizer split (digits one at a time, words with their leading space),
``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` special tokens, no BOS, ``<|im_end|>`` as
EOS, ChatML in the tokenizer config's ``chat_template``, and an embedding padded past the
tokenizer's size. Merges are learned from the text it is given (Python's bundled reference
documentation for general English, plus the task's transcripts).
"""

from __future__ import annotations

from typing import Iterable

from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2.5): contractions, words with one
# leading non-letter, single digits, punctuation runs, newlines, spaces
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML as Qwen2 writes it, without Qwen's default system prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_chat_tokenizer(texts: Iterable[str], *, vocab_size: int,
                         model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Train byte-level BPE merges on ``texts`` up to ``vocab_size`` tokens (specials included;
    fewer when the text runs out of pairs to merge) and wrap it as a fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    extra = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, **extra)
