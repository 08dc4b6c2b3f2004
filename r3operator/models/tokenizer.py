"""A real, deterministic word-level tokenizer for the reference models (toy arithmetic/counting task).

Built with the `tokenizers` library so that vLLM's OpenAI server and `AutoTokenizer` both accept it
(a served model needs a real tokenizer; `--skip-tokenizer-init` makes the OpenAI endpoints refuse
requests). The vocabulary is a fixed list, so the file is byte-identical on every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an optional dependency, imported lazily at run time
    from tokenizers import Tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

_DIGITS = tuple(str(d) for d in range(10))
_SYMBOLS = ("+", "-", "*", "/", "=", "(", ")", ",", ".", "?", ":", "<", ">", "%")
_WORDS = (
    "add",
    "sum",
    "plus",
    "minus",
    "times",
    "divided",
    "by",
    "equals",
    "is",
    "what",
    "count",
    "to",
    "from",
    "the",
    "of",
    "and",
    "answer",
    "question",
    "Q",
    "A",
    "next",
    "number",
    "after",
    "before",
    "even",
    "odd",
    "yes",
    "no",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "zero",
    "double",
    "half",
    "apples",
    "has",
    "gives",
    "left",
    "total",
    "step",
    "first",
    "then",
    "so",
    "result",
    "user",
    "assistant",
    "think",
    "done",
)

# Jinja chat template: "<bos>user: ... \nassistant:" — enough for /v1/chat/completions to work.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def vocabulary(vocab_size: int) -> list[str]:
    """Fixed token list: specials, digits, symbols, words, then `<extra_i>` fillers up to vocab_size.

    The fillers keep `len(tokenizer) == config.vocab_size`, so every id the (random) model can sample
    decodes to a real token string.
    """
    base = [*SPECIAL_TOKENS, *_DIGITS, *_SYMBOLS, *_WORDS]
    if vocab_size < len(base):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the base vocabulary ({len(base)} tokens)")
    return base + [f"<extra_{i}>" for i in range(vocab_size - len(base))]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {tok: i for i, tok in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    # Digits one by one (so any number is representable), punctuation split off, words on whitespace.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(directory: Path, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(directory / "tokenizer.json"), pretty=True)
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
