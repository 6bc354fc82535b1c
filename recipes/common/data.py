"""Offline text, cut into documents of varying length, packed into steps of a fixed token budget.

Default corpus: ``pydoc_data.topics`` — the text of Python's language reference (about 465k
characters of English prose and code) that the standard library ships for ``help()``. Local
alternatives: a ``.txt`` file (one running text, cut like the default) or a ``.jsonl`` file (one
document per record; records longer than the longest document are split).

A step's documents are flattened into one row by transformers' ``DataCollatorWithFlattening``
(``return_flash_attn_kwargs=True``): no padding, positions restart at 0 in each document, the
first label of each document is -100, and ``cu_seq_lens_q/k`` give the document boundaries.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path

import torch

from .errors import RecipeError, flag

__all__ = [
    "STATS_KEY",
    "PackedCollator",
    "PackedDataset",
    "RecipeDataWarning",
    "build_dataset",
    "dataset_of",
    "cut_documents",
    "load_texts",
    "pack_documents",
    "warn_if_repeated",
]

# The collator's per-step counts ride in the batch under this key; the recipes pop it before the model call.
STATS_KEY = "recipe_stats"


def load_texts(*, dataset: str | None = None, text_field: str = "text") -> tuple[list[str], bool]:
    """``(texts, running)``: the texts, and whether they are running text to cut at random lengths
    (the default corpus, a ``.txt`` file) rather than documents to keep whole (``.jsonl`` records)."""
    if dataset is None:
        import pydoc_data.topics

        # Sorted by topic name: the same order, so the same documents, on every machine.
        return [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)], True
    path = Path(dataset)
    if not path.is_file():
        raise RecipeError(f"dataset {dataset!r} is not a local file: pass the path of a .txt or .jsonl file (nothing is downloaded)")
    try:
        if path.suffix != ".jsonl":
            texts, running = [path.read_text(encoding="utf-8")], True
        else:
            lines = enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            texts = [_record_text(line, text_field=text_field, where=f"{dataset}:{number}") for number, line in lines if line.strip()]
            running = False
    except UnicodeDecodeError as error:
        raise RecipeError(
            f"dataset {dataset!r} is not UTF-8 text ({error.reason} at byte {error.start}): pass a .txt or .jsonl file"
        ) from None
    if not any(text.strip() for text in texts):
        # Only the end-of-text token would be left: a step with nothing to predict, whose loss is NaN.
        raise RecipeError(f"dataset {dataset!r} has no text: pass a {flag('dataset')} with at least one non-empty document")
    return texts, running


def _record_text(line: str, *, text_field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise RecipeError(f"{where} is not a JSON record ({error.msg}): a .jsonl file holds one JSON object per line") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
        raise RecipeError(
            f"{where} has no field {text_field!r} (fields: {fields}): pass {flag('text_field')} with the field holding the text"
        )
    return str(record[text_field])


def cut_documents(token_texts: list[list[int]], *, running: bool, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Documents from tokenized texts.

    Running text is joined and cut into pieces whose lengths are log-uniform in
    ``[min_tokens, max_tokens]`` (many short documents, a few long ones, as in real fine-tuning
    sets). Whole documents are kept, except that one longer than ``max_tokens`` is split.
    """
    if min_tokens < 1 or max_tokens < min_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    documents = []
    if running:
        stream = [token for tokens in token_texts for token in tokens]
        start = 0
        while start < len(stream):
            length = round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
            documents.append(stream[start : start + length])
            start += length
    else:
        for tokens in token_texts:
            documents.extend(tokens[i : i + max_tokens] for i in range(0, len(tokens), max_tokens))
    return [doc for doc in documents if doc]


def pack_documents(documents: list[list[int]], *, tokens_per_step: int, seed: int) -> list[list[list[int]]]:
    """Shuffle, then fill each pack to exactly ``tokens_per_step`` tokens.

    The document that does not fit is split: its head ends this pack, its tail starts the next
    one as a document of its own. Every step then has the same token count (one tensor shape:
    steady graph caches and compiled kernels) and no padding. A last partial pack is dropped
    unless it is the only one.
    """
    order = list(documents)
    random.Random(seed).shuffle(order)
    packs, current, room = [], [], tokens_per_step
    for doc in order:
        while doc:
            piece, doc = doc[:room], doc[room:]
            current.append(piece)
            room -= len(piece)
            if room == 0:
                packs.append(current)
                current, room = [], tokens_per_step
    if current and not packs:
        packs.append(current)
    if not packs:
        raise RecipeError(f"the dataset has no text: pass a {flag('dataset')} with at least one non-empty document")
    return packs


class RecipeDataWarning(UserWarning):
    """The data is too small for the run: steps repeat it, or a step holds fewer tokens than its budget."""


def warn_if_repeated(
    *, packs: list[list[list[int]]], tokens_per_step: int, steps: int, world_size: int = 1, packs_per_step: int = 1
) -> str | None:
    """Warn (:class:`RecipeDataWarning`), with the numbers, when ``steps`` optimizer steps on ``world_size`` devices, each step
    taking ``packs_per_step`` packs of ``tokens_per_step`` tokens per device (batch size x gradient accumulation), would train
    on the same packs more than once or on fewer tokens than a step holds; returns the message (``None``: no warning)."""
    tokens = sum(len(doc) for pack in packs for doc in pack)
    step_tokens = tokens_per_step * packs_per_step
    per_device = math.ceil(len(packs) / world_size)  # each device draws its own packs (a distributed sampler)
    if tokens < step_tokens:
        # A step needs 2 tokens (data_budget): below that, only more data helps.
        fits = f"{flag('tokens_per_step', tokens // packs_per_step)} or less, or " if tokens // packs_per_step >= 2 else ""
        message = (
            f"the data has {tokens:,} tokens, fewer than one step's {step_tokens:,}: each of the {steps} steps trains on "
            f"the same {tokens:,} tokens; pass {fits}more data"
        )
    elif steps * packs_per_step > per_device:
        message = (
            f"the data fills {len(packs)} packs of {tokens_per_step:,} tokens ({per_device} per device): {steps} steps of "
            f"{packs_per_step} go over it {steps * packs_per_step / per_device:.1f} times; pass more data, fewer steps or a "
            f"smaller {flag('tokens_per_step')}"
        )
    else:
        return None
    warnings.warn(message, RecipeDataWarning, stacklevel=2)
    return message


class PackedDataset(torch.utils.data.Dataset):
    """One item per optimizer step: ``{"documents": [[ids], ...]}`` (use a batch size of 1)."""

    def __init__(self, packs: list[list[list[int]]]):
        self.packs = packs

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict:
        return {"documents": self.packs[index]}


class PackedCollator:
    """Flattens the documents of the items into one row with ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``.

    Adds ``batch[STATS_KEY]``: the real token count, the padded-equivalent count (documents x
    longest document: what one row per document would have computed), and the document lengths
    (for the attention FLOPs), all read here on the host so the step needs no synchronization.
    """

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def __call__(self, items: list[dict]) -> dict:
        documents = [doc for item in items for doc in item["documents"]]
        batch = self.flatten([{"input_ids": doc} for doc in documents])
        lengths = [len(doc) for doc in documents]
        batch[STATS_KEY] = {"tokens": sum(lengths), "padded_tokens": len(lengths) * max(lengths), "doc_lengths": lengths}
        return batch


def build_dataset(
    *, tokenizer, dataset: str | None, text_field: str, tokens_per_step: int, min_doc_tokens: int, max_doc_tokens: int, seed: int
) -> PackedDataset:
    """Load, tokenize (each text ends with eos), cut and pack: the dataset every recipe trains on."""
    texts, running = load_texts(dataset=dataset, text_field=text_field)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    token_texts = [tokenizer.encode(text) + eos for text in texts]
    documents = cut_documents(token_texts, running=running, min_tokens=min_doc_tokens, max_tokens=max_doc_tokens, seed=seed)
    packs = pack_documents(documents, tokens_per_step=tokens_per_step, seed=seed)
    # A document's first token has no label: a pack of one-token documents has nothing to predict and its loss is NaN.
    empty = sum(1 for pack in packs if all(len(doc) < 2 for doc in pack))
    if empty:
        raise RecipeError(
            f"{empty} of the {len(packs)} packs hold only one-token documents, whose single token has no label to predict: pass "
            f"longer documents ({flag('min_doc_tokens')}) or a larger {flag('tokens_per_step')}"
        )
    return PackedDataset(packs)


def dataset_of(options, *, tokenizer, seed: int) -> PackedDataset:
    """:func:`build_dataset` from a resolved :class:`~.config.RecipeOptions` (its data file and budget): what each engine trains on."""
    return build_dataset(
        tokenizer=tokenizer,
        dataset=options.dataset,
        text_field=options.text_field,
        tokens_per_step=options.tokens_per_step,
        min_doc_tokens=options.min_doc_tokens,
        max_doc_tokens=options.max_doc_tokens,
        seed=seed,
    )
