"""An offline word-level tokenizer over the lab's closed vocabulary, saved with every checkpoint.

Words, single digits and single punctuation marks are tokens, each with or without one leading space
(" code" and "code" are two tokens: this halves sequence lengths against a separate space token), plus
whitespace. The decoder concatenates tokens, so decode(encode(text)) == text for any text the task
generators emit. Digits are single tokens so that numbers of any size stay in the vocabulary.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlmerge.lab.tasks import FAMILIES, make_family

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPLIT_PATTERN = r" ?[A-Za-z_]+| ?\d| ?[^\w\s]|\s"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The lab tokenizer: special tokens, ASCII letters, digits, punctuation, whitespace, task words."""
    words: set[str] = set(string.ascii_lowercase) | set(string.digits) | set(string.punctuation) | {" ", "\n"}
    for name in FAMILIES:
        words |= set(make_family(name).words())
    words |= {" " + w for w in words if not w.isspace()}
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *sorted(words)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Left padding: batched generation appends to the right end of every prompt.
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
