"""`data=chat`: fine-tuning examples from local jsonl files, the loss on the responses only.

Each line is one example: a prompt and a response (`data.prompt_key`, `data.response_key`), or a
conversation (`data.messages_key`: a list of `{role, content}` ending with the assistant's turn)
put through the tokenizer's own chat template. The example's tokens are the prompt's, then the
response's (then end-of-sequence, `data.add_eos`); the target at each position is the next token
where that token belongs to the response, else IGNORE_INDEX (-100), as transformers' fine-tuning
labels are. Each example is one sample, padded to the window of model.seq_len + 1 tokens (padding
is never scored); or with `data.packing=documents` whole examples are packed into each window in
file order (the next window started when the next example would not fit), each with its position
ids from 0 (its own attention, as packed documents: data/packing.py) and its first token never a
target (the token before it is another example's). Examples are never split: one longer than the
window is refused before any rank starts, unless `data.truncate=true` cuts it to the window.

Sample i of the run (the global sample index) is example (or packed window) `perm_e[i mod n]`, e = i div n the epoch
and perm_e a permutation drawn from (seed, e), as data=hf draws its windows: every example is seen
once per epoch, and any (pp, dp) or a resumed run reads the same global batch at a given step.
The runtime weighs the loss by scored tokens over the whole global batch (`ModelSpec.scored`), so
a short example weighs as much per token as a long one whatever micro-batch it falls into.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from pipelaunch.pipeline.core import IGNORE_INDEX, POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.data.hf import _epoch_order, load_tokenizer
from pipelaunch.pipeline.data.lengths import check_buckets
from pipelaunch.pipeline.data.packing import FIELDS, Batch, check_packing


@dataclass
class Examples:
    """Tokenized examples, padded to one window: tokens and labels (IGNORE_INDEX where unscored),
    each [n, window], and each example's length before padding."""

    tokens: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    #: data.packing=documents: per window, each position's offset in its example (0 at each
    #: example's first token; the padding after the last one a segment of its own); None: unpacked
    positions: np.ndarray | None = None

    @property
    def scored(self) -> np.ndarray:
        """Per example, the targets its sample scores (labels after the first position)."""
        return (self.labels[:, 1:] != IGNORE_INDEX).sum(axis=1)


def read_jsonl(path: str, keys: list[str], key_of: dict[str, str]) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line of a jsonl file, every record holding `keys`;
    a line that is not a JSON object or lacks one names the file, the line and the config key."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("data.files", f"{path!r} does not exist (local jsonl files, one example per line; nothing "
                                        "is downloaded)")
    records = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError("data.files", f"{path} line {number} is not JSON ({err.msg}); each line holds one "
                                                "example, a JSON object") from None
            if not isinstance(record, dict):
                raise ConfigError("data.files", f"{path} line {number} is a JSON {type(record).__name__}, not an "
                                                "object holding the example's fields")
            for key in keys:
                if key not in record:
                    fields = ", ".join(map(repr, record)) or "none"
                    raise ConfigError(key_of[key], f"{path} line {number} has no {key!r} field (its fields: {fields});"
                                                   f" set {key_of[key]}=<the field holding it>")
            records.append((number, record))
    return records


@dataclass
class ChatExamples:
    """Prompt/response or chat examples, the loss on the responses (see the module docstring)."""

    files: list[str]
    tokenizer: str
    seq_len: int
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str | None = None
    truncate: bool = False
    add_eos: bool = True
    val_files: list[str] | None = None
    #: the lengths a micro-batch may run at (pipeline/data/lengths.py); None: model.seq_len only
    buckets: list[int] | None = None
    #: order each global batch's samples by length before cutting it (pipeline/data/lengths.py)
    group_by_length: bool = False
    #: none: one example per sample, padded; documents: whole examples packed into each window,
    #: each with its own positions and attention (`_pack`)
    packing: str = "none"
    seed: int = 0
    kind: str = "tokens"
    #: the targets hold IGNORE_INDEX (prompts, padding): the launcher checks the loss can weigh them
    masks_targets: ClassVar[bool] = True
    _tok: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ConfigError("model.seq_len", f"got {self.seq_len!r}: data=chat pads each example to model.seq_len "
                                               "tokens; set model.seq_len=<the longest example's tokens>")
        self.length_buckets = check_buckets(None if self.buckets is None else list(self.buckets), self.seq_len)
        self.packed = self.packing != "none" and check_packing(self.packing, 0)
        if self.packing == "stream":
            raise ConfigError("data.packing", "data=chat packs whole examples (documents) or one per sample (none); "
                                              "stream would split an example's prompt from its response")
        if self.packed and self.length_buckets is not None:
            raise ConfigError("data.buckets", "packed windows (data.packing=documents) are full: each runs at "
                                              "model.seq_len; set data.buckets=null, or data.packing=none")
        if self.group_by_length and self.length_buckets is None:
            raise ConfigError("data.group_by_length", "orders each global batch's samples so that each micro-batch "
                                                      "runs at a length of its own; set data.buckets too (e.g. "
                                                      f"data.buckets=[{max(1, self.seq_len // 4)},"
                                                      f"{max(1, self.seq_len // 2)}]), or data.group_by_length=false")
        self._tok = load_tokenizer(self.tokenizer)
        self.pad_id = next(i for i in (self._tok.pad_token_id, self._tok.eos_token_id, 0) if i is not None)
        self._train = self._load(self.files, "data.files")
        self._val = self._load(self.val_files, "data.val_files") if self.val_files else None

    # ---- reading and tokenizing -------------------------------------------------------------
    def _encode(self, path: str, number: int, record: dict) -> tuple[list[int], int]:
        """(the example's token ids, how many of them are the prompt's)."""
        tok = self._tok
        if self.messages_key is not None:
            messages = record[self.messages_key]
            if (not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages)
                    or messages[-1].get("role") != "assistant"):
                raise ConfigError("data.messages_key", f"{path} line {number}: {self.messages_key!r} is not a list of "
                                                       "{role, content} messages ending with the assistant's (the "
                                                       "response the loss scores)")
            try:
                prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
                text = tok.apply_chat_template(messages, tokenize=False)
            except Exception as err:  # noqa: BLE001 - no template, or one that refuses the messages
                raise ConfigError("data.tokenizer", f"its chat template cannot render {path} line {number}: {err}; "
                                                    "give a tokenizer with a chat_template, or prompt/response "
                                                    "fields (data.messages_key=null)") from None
            if not text.startswith(prompt):
                raise ConfigError("data.messages_key", f"{path} line {number}: the chat template renders the "
                                                       "conversation without its prompt as a prefix, so the response "
                                                       "cannot be told apart; use prompt/response fields")
            # the text tokenized as apply_chat_template does; a token holding any of the response's
            # characters is the response's (a BPE merges the prompt's trailing space into its first word)
            encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ends = [end for _, end in encoded["offset_mapping"]]
            head = next((i for i, end in enumerate(ends) if end > len(prompt)), len(ends))
            return list(encoded["input_ids"]), head
        prompt, response = record[self.prompt_key], record[self.response_key]
        for key, value in ((self.prompt_key, prompt), (self.response_key, response)):
            if not isinstance(value, str):
                raise ConfigError(f"data.{'prompt_key' if key == self.prompt_key else 'response_key'}",
                                  f"{path} line {number}: {key!r} is a {type(value).__name__}, not text")
        head = tok(prompt)["input_ids"]
        tail = tok(response, add_special_tokens=False)["input_ids"]
        eos = [tok.eos_token_id] if self.add_eos and tok.eos_token_id is not None else []
        return head + tail + eos, len(head)

    def _load(self, files: list[str] | str, key: str) -> Examples:
        files = [files] if isinstance(files, str) else list(files or [])
        if not files:
            raise ConfigError(key, "no files given; e.g. data.files=[/data/train.jsonl]")
        if self.messages_key is not None:
            keys = [self.messages_key]
            key_of = {self.messages_key: "data.messages_key"}
        else:
            keys = [self.prompt_key, self.response_key]
            key_of = {self.prompt_key: "data.prompt_key", self.response_key: "data.response_key"}
        encoded = [(path, number, *self._encode(path, number, record))
                   for path in files for number, record in read_jsonl(path, keys, key_of)]
        if not encoded:
            raise ConfigError(key, f"{', '.join(files)} hold no examples")
        window = self.seq_len + 1
        longest = max(encoded, key=lambda e: len(e[2]))
        if len(longest[2]) > window and not self.truncate:
            over = sum(len(e[2]) > window for e in encoded)
            raise ConfigError("model.seq_len", f"{self.seq_len} leaves a window of model.seq_len + 1 = {window} tokens, "
                                               f"shorter than {over} example(s), the longest {len(longest[2])} tokens "
                                               f"({longest[0]} line {longest[1]}); examples are not split: set "
                                               f"model.seq_len={len(longest[2]) - 1} (or more), or data.truncate=true "
                                               "to cut each example to the window (what is cut is not trained on)")
        rows = _pack([(ids[:window], prompt) for _, _, ids, prompt in encoded], window) if self.packed else \
            [[(ids[:window], prompt)] for _, _, ids, prompt in encoded]
        tokens = np.full((len(rows), window), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), window), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), window), dtype=np.int64)
        lengths = np.zeros(len(rows), dtype=np.int64)
        for row, examples in enumerate(rows):
            at = 0
            for ids, prompt in examples:
                tokens[row, at:at + len(ids)] = ids
                # scored: the response's tokens; never an example's first (the one before is another's)
                labels[row, at + max(prompt, 1):at + len(ids)] = ids[max(prompt, 1):]
                positions[row, at:at + len(ids)] = np.arange(len(ids))
                at += len(ids)
            positions[row, at:] = np.arange(window - at)  # the padding: a segment of its own
            lengths[row] = at
        return Examples(tokens, labels, lengths, positions if self.packed else None)

    def check_vocabulary(self, model_vocab: int) -> None:
        """Refuse a tokenizer that can produce ids the model cannot embed."""
        if len(self._tok) > model_vocab:
            raise ConfigError("data.tokenizer", f"{self.tokenizer} has {len(self._tok)} tokens, more than the model's "
                                                f"vocabulary of {model_vocab} (model.vocab_size); use the tokenizer "
                                                "the model was trained with, or a model with a larger vocabulary")

    # ---- batches ------------------------------------------------------------------------------
    def _picks(self, examples: Examples, first: int, count: int, salt: str) -> np.ndarray:
        n = len(examples.lengths)
        index = np.arange(first, first + count)
        picks = np.empty(count, dtype=np.int64)
        for epoch in np.unique(index // n):
            at = index // n == epoch
            picks[at] = _epoch_order(self.seed, salt, int(epoch), n)[index[at] % n]
        return picks

    def _rows(self, examples: Examples, first: int, count: int, salt: str) -> Batch:
        picks = self._picks(examples, first, count, salt)
        tokens, labels = examples.tokens[picks], examples.labels[picks]
        inputs, targets = torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(labels[:, 1:].copy())
        if examples.positions is None:
            return inputs, targets
        return inputs, targets, {POSITION_IDS: torch.from_numpy(examples.positions[picks, :-1].copy())}

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-token fields a batch gives beside inputs and targets (packing: position ids)."""
        return FIELDS if self.packed else ()

    def batch(self, step: int, batch_size: int) -> Batch:
        return self._rows(self._train, step * batch_size, batch_size, "chat")

    def val_batch(self, index: int, batch_size: int) -> Batch:
        """Held-out batch `index` (from val_files, or the training examples when there are none)."""
        examples = self._val if self._val is not None else self._train
        return self._rows(examples, index * batch_size, batch_size, "val")

    def scored_per_sample(self, first: int, count: int) -> np.ndarray:
        """The scored targets of training samples first..first+count-1, without building them (the
        launcher's check that no micro-batch of the run is without one)."""
        return self._train.scored[self._picks(self._train, first, count, "chat")]

    def sample_lengths(self, step: int, batch_size: int, held_out: bool = False) -> np.ndarray:
        """The input positions each sample of batch `step` uses (its tokens but the last), without
        building the batch: what sets each micro-batch's length under data.buckets."""
        examples = self._val if held_out and self._val is not None else self._train
        picks = self._picks(examples, step * batch_size, batch_size, "val" if held_out else "chat")
        return np.maximum(examples.lengths[picks] - 1, 1)

    def padded_tokens(self, step: int, batch_size: int) -> int:
        """Input positions of batch `step` that are padding (an example's input is its tokens but
        the last, padded to model.seq_len)."""
        lengths = self._train.lengths[self._picks(self._train, step * batch_size, batch_size, "chat")]
        return int((self.seq_len - (lengths - 1)).sum())


def _pack(examples: list[tuple[list[int], int]], window: int) -> list[list[tuple[list[int], int]]]:
    """data.packing=documents: whole examples (ids, prompt length) in file order, each window
    filled until the next would not fit, then the next window (examples are never split)."""
    rows: list[list[tuple[list[int], int]]] = [[]]
    used = 0
    for ids, prompt in examples:
        if used + len(ids) > window and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append((ids, prompt))
        used += len(ids)
    return rows
