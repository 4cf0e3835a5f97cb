"""Training records: read a file in any of four record formats, tokenize each with its loss mask.

Formats, detected from the first record's fields (every record must then have that format's fields):

- alpaca: ``{instruction, input?, output}``, formatted with the standard alpaca prompt (``PROMPT_*``);
  loss on the output.
- chat: ``{messages: [{role, content}, ...]}``, rendered with the tokenizer's chat template; loss on the
  assistant turns only. Roles are system, user, assistant, tool, or a name the template quotes (``template_roles``).
- prompt/completion: ``{prompt, completion}``; loss on the completion.
- text: ``{text}``; loss on every token.

Files: a JSON list, JSONL (one record per line), parquet (a file or a directory of them), or a
directory written by ``datasets``' ``save_to_disk``.
"""

import difflib
import glob
import json
import os
import re

import torch

from megablocks_utils.errors import DataError

# The label of a position the loss skips (prompt, padding): transformers' and torch's cross-entropy default.
IGNORE_INDEX = -100

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


# format -> (fields every record needs, optional string fields)
FORMATS = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ()),
    "prompt_completion": (("prompt", "completion"), ()),
    "text": (("text",), ()),
}


CHAT_ROLES = ("system", "user", "assistant", "tool")


FILE_KINDS = "a JSON list, JSONL, parquet, or a directory written by datasets' save_to_disk"


def _json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _load_json(path: str) -> list:
    """A JSON list, or JSONL: one JSON object per line (a .jsonl file, or a file that is not one JSON value)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}); it must be {FILE_KINDS}") from e
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not path.endswith(".jsonl"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as whole:
            if len(lines) < 2 or not lines[0][1].lstrip().startswith("{"):
                raise DataError(f"{path} is not valid JSON ({whole}); it must be a JSON list of records, or JSONL") from whole
    records = []
    for n, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n} is not valid JSON ({e}); JSONL holds one JSON object per line") from e
    return records


def _load_with_datasets(path: str) -> list:
    """Parquet files or a save_to_disk directory, through ``datasets``' own loaders."""
    import datasets

    datasets.disable_progress_bars()
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_info.json"))
                                or os.path.isfile(os.path.join(path, "dataset_dict.json"))):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"{path} is a DatasetDict without a 'train' split (it has {', '.join(loaded)}); "
                                f"point data_path at one split's directory, e.g. {os.path.join(path, next(iter(loaded)))}")
            loaded = loaded["train"]
        return loaded.to_list()
    files = sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.parquet"), recursive=True)) if os.path.isdir(path) else [path]
    if not files:
        raise DataError(f"data path {path!r} is a directory with neither a save_to_disk dataset nor parquet files; "
                        f"set data_path to {FILE_KINDS}")
    try:
        return datasets.load_dataset("parquet", data_files=files, split="train").to_list()
    except Exception as e:  # pyarrow's ArrowInvalid, or datasets wrapping it: say which file, not a traceback
        if type(e).__module__.split(".")[0] not in ("pyarrow", "datasets"):
            raise
        raise DataError(f"{path} cannot be read as parquet ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        f"re-write the file, or give {FILE_KINDS}") from e


def detect_format(record, path: str = "data") -> str:
    """The format whose required fields ``record`` has (the first record decides for the whole file)."""
    if not isinstance(record, dict):
        raise DataError(f"{path}: record 0 is {_json_kind(record)}, not an object with instruction and output")
    for name, (required, _) in FORMATS.items():
        if all(k in record for k in required):
            return name
    if "instruction" in record or "output" in record:
        return "alpaca"  # its missing field is named below
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    raise DataError(f"{path}: record 0 has none of the fields of a known format (its fields: {', '.join(record) or 'none'}); "
                    "use instruction/output (alpaca), messages (chat), prompt/completion, or text")


def _check_messages(path: str, i: int, messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{path}: record {i} field 'messages' is {_json_kind(messages)}, not a non-empty list of "
                        "{role, content} objects; fix the record")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{path}: record {i} message {j} is not an object with string 'role' and 'content'; fix the record")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{path}: record {i} has no assistant message, so nothing to train on; add one or drop the record")


def check_records(records, path: str) -> str:
    """Check every record against the format of the first; returns the format's name."""
    if not isinstance(records, list):
        raise DataError(f"{path} holds {_json_kind(records)}, not a list; wrap the records in [ ... ]")
    if not records:
        raise DataError(f"{path} holds no records; add records to train on")
    fmt = detect_format(records[0], path)
    required, optional = FORMATS[fmt]
    need = " and ".join(required)
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} is {_json_kind(record)}, not an object with {need}")
        for key in required:
            if key not in record:
                raise DataError(f"{path}: record {i} has no {key!r} field; every record needs {need} ({fmt} format, "
                                "detected from record 0)")
        if fmt == "chat":
            _check_messages(path, i, record["messages"])
            continue
        for key in (*required, *optional):
            if key in record and record[key] is not None and not isinstance(record[key], str):
                raise DataError(f"{path}: record {i} field {key!r} is {_json_kind(record[key])}, not a string; fix the record")
    return fmt


_LAST_READ: dict = {}  # the last two read_records results (train and eval data), by path and its files' sizes and times


def _stamp(path: str) -> tuple:
    """What changes when a data file or directory changes: its entries' sizes and modification times."""
    paths = [path] if not os.path.isdir(path) else sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
    return tuple((p, s.st_size, s.st_mtime_ns) for p, s in ((p, os.stat(p)) for p in paths))


def read_records(path: str) -> tuple[list[dict], str]:
    """Read and check a data file or directory: its records and their format.

    The scripts call this twice per process, to check the inputs before anything heavy and again to tokenize:
    the second call of the same unchanged path returns the first one's records (the list is not modified)."""
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist; set data_path to {FILE_KINDS}")
    key = (os.path.abspath(path), _stamp(path))
    if key in _LAST_READ:
        return _LAST_READ[key]
    if os.path.isdir(path) or path.endswith(".parquet"):
        records = _load_with_datasets(path)
    else:
        records = _load_json(path)
    result = records, check_records(records, path)
    _LAST_READ[key] = result
    while len(_LAST_READ) > 2:
        del _LAST_READ[next(iter(_LAST_READ))]
    return result


def read_alpaca(path: str) -> list[dict]:
    """Alpaca records only (the embedded tokenizer is trained on them)."""
    records, fmt = read_records(path)
    if fmt != "alpaca":
        raise DataError(f"{path} holds {fmt} records; this needs alpaca records (instruction, input, output)")
    return records


def format_prompt(record: dict) -> str:
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input") or "")


def _with_bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _sample(input_ids: list[int], labels: list[int], max_length: int) -> dict:
    input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "labels": labels, "num_label_tokens": sum(x != IGNORE_INDEX for x in labels[1:])}


def _prompt_then_response(prompt_text: str, response_text: str, tokenizer, max_length: int) -> dict:
    """<bos> prompt response <eos>; labels are -100 on <bos> and the prompt.

    Prompt and response are tokenized separately so the boundary between them is exact.
    """
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response = tokenizer(response_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    bos = _with_bos(tokenizer)
    return _sample(bos + prompt + response, [IGNORE_INDEX] * (len(bos) + len(prompt)) + response, max_length)


def tokenize_record(record: dict, tokenizer, max_length: int) -> dict:
    """An alpaca record: input_ids = <bos> prompt response <eos>; labels are -100 on <bos> and the prompt."""
    return _prompt_then_response(format_prompt(record), record["output"], tokenizer, max_length)


def tokenize_text(record: dict, tokenizer, max_length: int) -> dict:
    """<bos> text <eos>, every token a label."""
    ids = _with_bos(tokenizer) + tokenizer(record["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return _sample(ids, list(ids), max_length)


def _assistant_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn.

    For templates without ``{% generation %}`` markers (Mixtral's, for one): the turn is what rendering
    ``messages[:i+1]`` adds to rendering ``messages[:i]`` with the generation prompt. That needs a
    template whose rendering of a prefix is a prefix of the whole; one that rewrites earlier turns
    gets an error.
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError("the tokenizer's chat template renders earlier turns differently once later ones follow, so "
                            "the assistant turns cannot be located; give the template {% generation %} markers")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_chat(record: dict, tokenizer, max_length: int) -> dict:
    """The conversation through the tokenizer's chat template; labels on the assistant turns only."""
    messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text, spans = _assistant_spans(messages, tokenizer)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return _sample(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)], max_length)


def tokenize_prompt_completion(record: dict, tokenizer, max_length: int) -> dict:
    return _prompt_then_response(record["prompt"], record["completion"], tokenizer, max_length)


TOKENIZERS = {"alpaca": tokenize_record, "chat": tokenize_chat, "prompt_completion": tokenize_prompt_completion,
              "text": tokenize_text}


def check_tokenizer_for(fmt: str, tokenizer, source: str) -> None:
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the data holds chat records (messages) but the tokenizer of {source} has no chat template; add "
                        "one to its tokenizer_config.json (chat_template), or use alpaca, prompt/completion or text records")


def template_roles(tokenizer) -> set[str]:
    """The roles chat records may use: the standard four and every quoted name in the tokenizer's chat template.

    A template with roles of its own (Llama 3.1's 'ipython', gpt-oss's 'developer') compares the role with a quoted
    name; every quoted name is the simple superset of those. It lets through a few field names ('content'), never a
    name the template does not mention ('bot', 'User'), which a template would render as-is or drop, silently."""
    template = tokenizer.chat_template
    text = "\n".join(template.values()) if isinstance(template, dict) else template  # a tokenizer may name several
    quoted = re.finditer(r"""(['"])([A-Za-z_][\w-]*)\1""", text)
    return {*CHAT_ROLES, *(m.group(2) for m in quoted)}


def check_chat_roles(records: list, tokenizer, path: str, source: str) -> None:
    """Here, not in ``check_records``: a template's own roles are known only once the tokenizer is."""
    known = template_roles(tokenizer)
    for i, record in enumerate(records):
        for j, m in enumerate(record["messages"]):
            if m["role"] not in known:
                close = difflib.get_close_matches(m["role"].lower(), CHAT_ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DataError(f"{path}: record {i} message {j} has role {m['role']!r}{hint}; roles are "
                                f"{', '.join(CHAT_ROLES)}, or one the chat template of {source} names; fix the record")


def split_eval(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """A fixed, seeded held-out share of the records: (train, eval)."""
    if fraction <= 0:
        return records, []
    n_eval = max(1, round(len(records) * fraction))
    if n_eval >= len(records):
        raise DataError(f"eval_split={fraction} leaves no training records out of {len(records)}; lower it")
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_eval])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def tokenize_records(records: list, fmt: str, tokenizer, max_length: int, path: str):
    """Tokenized ``datasets.Dataset``; samples whose labels are truncated away entirely are dropped."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()  # a few hundred samples tokenize in a blink; the bars only clutter the log
    tokenize = TOKENIZERS[fmt]
    dataset = Dataset.from_list([tokenize(r, tokenizer, max_length) for r in records])
    kept = dataset.filter(lambda r: r["num_label_tokens"] > 0)
    if len(kept) == 0:
        raise DataError(f"no sample of {path} has a label token within max_length={max_length} (every prompt is "
                        "longer, or every record is empty); raise max_length")
    return kept, len(dataset) - len(kept)


def build_dataset(path: str, tokenizer, max_length: int, *, eval_split: float = 0.0, seed: int = 0, source: str = "the model"):
    """(train dataset, dropped count, eval records) from a data path: read, check, split, tokenize."""
    records, fmt = read_records(path)
    check_tokenizer_for(fmt, tokenizer, source)
    if fmt == "chat":
        check_chat_roles(records, tokenizer, path, source)
    train, held = split_eval(records, eval_split, seed)
    dataset, dropped = tokenize_records(train, fmt, tokenizer, max_length, path)
    return dataset, dropped, (held, fmt)
