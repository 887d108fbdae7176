"""A small byte-level BPE tokenizer with a ChatML template, trained offline on given text.

Random-weight benchmark checkpoints (and the tests' tiny ones) need a real tokenizer and a
real chat template, and the hub is out of reach: this trains one in well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Ids 0, 1, 2: pad/unk, bos (turn opener), eos (end of turn) — what the configs name."""


def chatml_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts``, ChatML ready."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
