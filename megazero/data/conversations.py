"""Fine-tuning records (``--sft``): conversations read from JSON-lines files and their token ids with
the tokens the loss trains on (the assistant's).

A line is one conversation, in one of two shapes:

* ``{"messages": [{"role": "system"|"user"|"assistant", "content": TEXT}, ...]}`` (Megatron-LM's SFT
  format; ``"conversations"`` is read as ``"messages"``);
* ``{"prompt": TEXT, "response": TEXT}`` (optionally ``"system": TEXT``): a user turn and the
  assistant's answer.

``--sft-tokenizer-prompt-format`` (Megatron-LM's names) says how turns become tokens:

* ``default``: the Hugging Face tokenizer's own chat template.  The whole conversation is rendered
  once and tokenized once; an assistant turn's tokens are those whose text lies between the template
  rendered up to that turn with the generation prompt (the ``<|im_start|>assistant`` header, which is
  not trained) and the template rendered through that turn.  A template whose renderings are not
  prefixes of each other (one that rewrites earlier turns) is refused.
* ``identity``: no template; each turn's text is encoded as it is and the turns are laid end to end
  (any tokenizer that encodes text).

Every conversation ends with the end-of-document id (appended unless the template ends with it); it is
trained when the last turn is the assistant's, so the model learns to stop.
"""
from __future__ import annotations

import json
from typing import List, Sequence, Tuple

ROLES = ("system", "user", "assistant")


def read_conversations(path: str) -> List[Tuple[int, list]]:
    """``[(line number, messages)]`` of a JSON-lines file; a ValueError naming ``path:line`` for a line
    that is not one of the two shapes."""
    out = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{number}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
            out.append((number, _messages(record, f"{path}:{number}")))
    return out


def _messages(record, where: str) -> list:
    if isinstance(record, dict) and ("messages" in record or "conversations" in record):
        messages = record.get("messages", record.get("conversations"))
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + \
            [{"role": "user", "content": record["prompt"]},
             {"role": "assistant", "content": record["response"]}]
    else:
        raise ValueError(f"{where}: a conversation is {{\"messages\": [{{\"role\": ..., \"content\": ...}}, "
                         "...]} or {\"prompt\": ..., \"response\": ...}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of turns")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: each turn is {{\"role\": system|user|assistant, \"content\": TEXT}}, "
                             f"got {json.dumps(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing to train on")
    return messages


def resolve_format(fmt, tokenizer) -> str:
    """The prompt format to use: ``fmt``, or without one the tokenizer's chat template when it has one
    (``default``), else ``identity``."""
    has_template = bool(getattr(getattr(tokenizer, "tok", None), "chat_template", None))
    if fmt is None:
        return "default" if has_template else "identity"
    if fmt == "default" and not has_template:
        raise ValueError("--sft-tokenizer-prompt-format default needs a Hugging Face tokenizer with a chat "
                         "template (--tokenizer-model DIR whose tokenizer_config.json or chat_template.jinja "
                         "has one); use identity for plain text")
    return fmt


def encode(messages: Sequence[dict], tokenizer, fmt: str, eod: int) -> Tuple[List[int], List[bool]]:
    """``(ids, trained)``: the conversation's token ids, ending with ``eod``, and for each whether it is an
    assistant token (a label the loss trains)."""
    if fmt == "identity":
        ids, trained = [], []
        for m in messages:
            piece = tokenizer.encode(m["content"])
            ids += piece
            trained += [m["role"] == "assistant"] * len(piece)
    else:
        ids, trained = _chat_template(messages, tokenizer.tok)
    if not ids or ids[-1] != eod:
        ids.append(eod)
        trained.append(messages[-1]["role"] == "assistant")
    return ids, trained


def _chat_template(messages: Sequence[dict], tok) -> Tuple[List[int], List[bool]]:
    """Render the whole conversation with ``tok``'s chat template, tokenize it once, and mark the tokens
    whose text lies in an assistant turn's answer (after its generation prompt)."""
    def render(upto: int, prompt: bool = False) -> str:
        try:
            return tok.apply_chat_template(list(messages[:upto]), tokenize=False,
                                           add_generation_prompt=prompt)
        except Exception as err:  # noqa: BLE001 - a template raises what it likes (jinja's raise_exception)
            raise ValueError(f"the tokenizer's chat template refused the conversation ({type(err).__name__}: "
                             f"{' '.join(str(err).split())})") from None
    text = render(len(messages))
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(k, prompt=True), render(k + 1)
        if not (text.startswith(end) and end.startswith(start)):
            raise ValueError("the tokenizer's chat template renders earlier turns differently once later "
                             "ones follow, so the assistant's tokens cannot be found; use "
                             "--sft-tokenizer-prompt-format identity")
        spans.append((len(start), len(end)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    trained = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    return ids, trained
