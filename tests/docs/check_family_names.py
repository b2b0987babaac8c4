#!/usr/bin/env python3
"""A family's names are spelled in its family file and the registry only (issue 24).

The registry (engine/family.cc) holds one row per family: the GGUF architecture, the name people
use and, where there is one, a short alias (expert-forge's --arch). The architecture and the alias
-- the names code dispatches on -- inside a
string literal of the product's C++/CUDA code, must sit in engine/family.cc or in the family's own
file, engine/families/<file>.cc (the row's `file` column). Anywhere else the code asks the
registry: family_info(Family::X).arch, .name, find_family(arch). The name people use ("GLM-4.5")
is prose and not checked. Comments do not count, and the
tests, the fixtures' Python generators and the documents are outside the check.

Two namespaces are not families, though some of their names are equal to a family's, and are
exempt file by file (EXEMPT): chat templates (engine/chat_template.cc names "gpt-oss" or
"deepseek4" *templates*, which also serve other families' fine-tunes) and tokenizer
pre-tokenizers (engine/tokenizer.cc). `llama` is checked only as the architecture key prefix
("llama." before a key, not "llama.cpp"), since "llama" alone is also the SentencePiece tokenizer model and a chat template.

Usage: check_family_names.py ROOT [FILE...]   With FILEs, check those (as if they were product
files outside every family file) instead of the tree. Exit 1, listing each name with its file
and line, when any is spelled where it should not be.
"""
import pathlib
import re
import sys

CODE_DIRS = ["base", "cache", "client", "daemon", "engine", "forge", "kernels", "policy",
             "storage", "tools", "trace", "tune", "bench", "testing", "examples"]
SUFFIXES = {".h", ".cc", ".cu", ".cuh"}
SKIP_PARTS = {"reference"}  # tools/reference: the fixtures' generators (Python) and their data
REGISTRY = "engine/family.cc"
EXEMPT = {
    "engine/chat_template.cc": "chat template names (their own namespace)",
    "engine/chat_template.h": "chat template names (their own namespace)",
    "engine/tokenizer.cc": "tokenizer.ggml.pre / tokenizer.ggml.model values",
    "engine/tokenizer.h": "tokenizer.ggml.pre / tokenizer.ggml.model values",
}
ROW = re.compile(r'FamilyInfo\{Family::(\w+),\s*"([^"]*)",\s*"([^"]*)",\s*"([^"]*)",\s*'
                 r'"([^"]*)"', re.S)


def registry_rows(root):
    """(enumerator, file, names) per row of the registry table."""
    text = (root / REGISTRY).read_text(encoding="utf-8")
    rows = []
    for m in ROW.finditer(text):
        enum, arch, name, alias, file = m.groups()
        names = {n for n in (arch, alias) if n}
        if "llama" in names:  # see the module's comment
            names.discard("llama")
            names.add("llama.")
        rows.append((enum, file, names))
    if len(rows) < 6:
        sys.exit(f"{REGISTRY}: found {len(rows)} FamilyInfo rows; the parser no longer matches "
                 "the table")
    return rows


def literals(text):
    """(line, contents) of every string literal in C/C++ source, comments skipped."""
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            line += text.count("\n", i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            k = text.find("(", i + 2)
            delim = text[i + 2:k]
            end = text.find(")" + delim + '"', k)
            end = n if end < 0 else end
            yield line, text[k + 1:end]
            line += text.count("\n", i, end)
            i = end + len(delim) + 2
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            if c == '"':
                yield line, text[i + 1:j]
            i = j + 1
        else:
            i += 1


def spelled(names, lit):
    for name in names:
        # A whole word: not part of a longer identifier or name ("qwen3moe" in "qwen3moe.x" counts,
        # "deepseek2" in "deepseek23" does not).
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])" if not name.endswith(".")
                     else rf"(?<![\w-]){re.escape(name)}(?!cpp\b)", lit):
            yield name


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = pathlib.Path(sys.argv[1])
    rows = registry_rows(root)
    if len(sys.argv) > 2:
        files = [pathlib.Path(f) for f in sys.argv[2:]]
    else:
        files = sorted(p for d in CODE_DIRS if (root / d).is_dir() for p in (root / d).rglob("*")
                       if p.suffix in SUFFIXES and not SKIP_PARTS & set(p.relative_to(root).parts))
    bad = []
    for path in files:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        if rel == REGISTRY or rel in EXEMPT:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for line, lit in literals(text):
            for enum, file, names in rows:
                if rel in (f"engine/families/{file}.cc", f"engine/families/{file}.h"):
                    continue
                for name in spelled(names, lit):
                    bad.append(f"{rel}:{line}: \"{name}\" (Family::{enum}) in \"{lit[:60]}\"")
    if bad:
        print(f"{len(bad)} family name(s) spelled outside their family file and {REGISTRY}; ask "
              "the registry (family_info, find_family) instead:")
        print("\n".join(bad))
        return 1
    print(f"ok: {len(files)} files, {len(rows)} families: each name only in its family file and "
          "the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
