"""Tokenizers that need no download: UTF-8 bytes by default, or a local Hugging Face tokenizer directory.

A byte tokenizer makes one token per byte of English text, so a step's token count is its text
length, and the vocabulary (256 bytes + 3 specials) needs no training and no files.
"""

from __future__ import annotations

from pathlib import Path

from .errors import RecipeError, flag

__all__ = ["ByteTokenizer", "HFTokenizer", "NoTokenizerFiles", "load_tokenizer"]


class ByteTokenizer:
    """Token ``b`` is byte ``b`` of the UTF-8 text; 256, 257 and 258 are pad, bos and eos.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi")
        [104, 105]
        >>> tok.decode([104, 105, tok.eos_token_id])
        'hi'
    """

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    # Rounded up to a multiple of 8 for the embedding and LM-head matmuls; ids 259-263 are never produced.
    vocab_size = 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class NoTokenizerFiles(RecipeError):
    """A local directory holds no tokenizer ``AutoTokenizer`` can load; ``first_line`` is the first line of its error."""

    def __init__(self, path: str, first_line: str):
        super().__init__(
            f"tokenizer directory {path!r} holds no tokenizer transformers can load ({first_line}): pass a {flag('tokenizer')} "
            f"directory with the tokenizer's files (tokenizer.json or tokenizer_config.json and its vocabulary)"
        )
        self.first_line = first_line


class HFTokenizer:
    """A local ``transformers`` tokenizer behind the same small interface (``encode``, ``vocab_size``, special ids)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            # Never a hub name: recipes run offline, and a typo must not start a download.
            raise RecipeError(f"tokenizer directory {str(path)!r} does not exist: pass a local directory (recipes download nothing)")
        try:
            self.inner = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as error:
            # transformers' message runs over several lines; its first says what it missed.
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise NoTokenizerFiles(str(path), first) from error
        self.vocab_size = len(self.inner)
        self.eos_token_id = self.inner.eos_token_id
        self.bos_token_id = self.inner.bos_token_id
        self.pad_token_id = self.inner.pad_token_id if self.inner.pad_token_id is not None else self.inner.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.inner(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


def load_tokenizer(*, tokenizer: str | None = None, checkpoint: str | None = None):
    """``tokenizer`` if given, else the checkpoint directory's tokenizer, else a :class:`ByteTokenizer`."""
    if tokenizer is not None:
        return HFTokenizer(tokenizer)
    if checkpoint is not None:
        if not Path(checkpoint).is_dir():
            raise RecipeError(f"checkpoint directory {checkpoint!r} does not exist: pass a local directory (recipes download nothing)")
        try:
            return HFTokenizer(checkpoint)
        except NoTokenizerFiles as error:
            message = f"checkpoint directory {checkpoint!r} has no tokenizer ({error.first_line}): pass {flag('tokenizer', 'DIR')}"
            raise RecipeError(message) from error
    return ByteTokenizer()
