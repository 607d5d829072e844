"""An offline word-level tokenizer over the lab's closed vocabulary, saved with every checkpoint.

Words, single digits and single punctuation marks are tokens, each with or without one leading space
(" code" and "code" are two tokens: this halves sequence lengths against a separate space token), plus
whitespace. The decoder concatenates tokens, so decode(encode(text)) == text for any text the task
generators emit. Digits are single tokens so that numbers of any size stay in the vocabulary.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlmerge.errors import InputError
from rlmerge.io.tokenizer import LOADABLE, loadable_tokenizer
from rlmerge.lab.tasks import FAMILIES, make_family

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
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


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """Load a checkpoint's tokenizer, keeping the lab's own tokenizer intact.

    transformers 5's AutoTokenizer swaps in the architecture's registered class (Qwen2Tokenizer, a
    byte-level BPE) for a generic `TokenizersBackend`, which silently re-tokenizes the lab's word-level
    vocabulary into characters. A checkpoint that declares the generic class gets it, read straight from
    its tokenizer.json; any other checkpoint goes through AutoTokenizer as usual.
    """
    folder = Path(path)
    if folder.is_dir() and not loadable_tokenizer(folder):
        # AutoTokenizer would build an empty one from config.json alone: every prompt encodes to nothing
        raise InputError(f"no tokenizer files ({', '.join(LOADABLE)})", file=str(folder),
                         hint="copy the base model's tokenizer files into it (rlmerge copies the base's into "
                              "every merge it writes), or give rlmerge eval --tokenizer BASE_DIR")
    config_file = folder / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in GENERIC_CLASSES:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return tok
