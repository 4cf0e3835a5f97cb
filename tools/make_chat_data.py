"""Write data_chat.jsonl: chat records made from the documentation Python itself ships.

Run from the repository root: ``python tools/make_chat_data.py`` (Python 3.11; the committed file was made with
3.11.7). Deterministic: the same Python writes the same file byte for byte.

Real text with real length spread, not repeated records: each conversation asks about one to three public
functions or classes of a standard-library module, and the assistant answers with the object's own docstring
(its documentation as installed); some conversations ask about a topic of the language reference
(``pydoc_data.topics``, the text ``help()`` shows), whose answers run to thousands of tokens. Nothing is
downloaded. Used by bench/real_data.py as the second real-data set beside data.json.
"""

import importlib
import inspect
import json
import random
import re
import warnings

MODULES = sorted("""
abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections colorsys contextlib copy csv
dataclasses datetime decimal difflib enum filecmp fnmatch fractions ftplib functools getopt gettext glob graphlib gzip
hashlib heapq hmac html http.client imaplib inspect io ipaddress itertools json locale logging lzma mailbox math
mimetypes operator optparse os os.path pathlib pickle pkgutil platform plistlib poplib pprint queue quopri random re
sched secrets select selectors shelve shlex shutil signal smtplib socket sqlite3 ssl statistics string struct
subprocess symtable tarfile tempfile textwrap threading time timeit tokenize trace traceback typing unicodedata
unittest urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib
""".split())
QUESTIONS = [
    "What does `{name}` do?",
    "Explain `{name}` from the Python standard library.",
    "How do I use `{name}`?",
    "Can you document `{name}` for me?",
    "I came across `{name}` in some code. What is it for?",
]
FOLLOW_UPS = ["And `{name}`?", "What about `{name}`?", "Now explain `{name}`.", "How does `{name}` work?"]
MIN_DOC_CHARS = 120


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)  # default values' addresses change from run to run


def documented_objects() -> list[tuple[str, str]]:
    """(qualified name with signature, docstring) of every public function, class and class method with a real
    docstring of its own."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for attr in sorted(getattr(module, "__all__", None) or dir(module)):
                if attr.startswith("_"):
                    continue
                obj = getattr(module, attr, None)
                if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                    continue
                if (getattr(obj, "__module__", None) or module_name).split(".")[0] != module_name.split(".")[0]:
                    continue  # re-exported from elsewhere: documented under its own module
                doc = inspect.getdoc(obj) or ""
                if len(doc) < MIN_DOC_CHARS:
                    continue
                found.append((f"{module_name}.{attr}{_signature(obj)}", doc))
                if not inspect.isclass(obj):
                    continue
                for method_name, method in sorted(vars(obj).items()):
                    method_doc = inspect.getdoc(method) if callable(method) and not method_name.startswith("_") else ""
                    if method_doc and len(method_doc) >= MIN_DOC_CHARS and method_doc != doc:
                        found.append((f"{module_name}.{attr}.{method_name}{_signature(method)}", method_doc))
    return found


def topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics as texts

    return [(name, text.strip()) for name, text in sorted(texts.items()) if len(text) >= MIN_DOC_CHARS]


def main() -> None:
    rng = random.Random(0)
    objects = documented_objects()
    rng.shuffle(objects)
    records = []
    i = 0
    while i < len(objects):
        turns = min(rng.choice([1, 1, 1, 2, 2, 3]), len(objects) - i)
        messages = []
        for t, (name, doc) in enumerate(objects[i : i + turns]):
            question = (rng.choice(QUESTIONS) if t == 0 else rng.choice(FOLLOW_UPS)).format(name=name)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": doc}]
        records.append({"messages": messages})
        i += turns
    for name, text in topics():
        records.append({"messages": [{"role": "user", "content": f"Explain the Python language topic '{name}'."},
                                     {"role": "assistant", "content": text}]})
    rng.shuffle(records)
    with open("data_chat.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    chars = sum(len(m["content"]) for r in records for m in r["messages"])
    print(f"wrote data_chat.jsonl: {len(records)} conversations from {len(objects)} docstrings and {len(topics())} "
          f"reference topics, {chars / 1e6:.1f} M characters")


if __name__ == "__main__":
    main()
