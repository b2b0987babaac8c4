#!/usr/bin/env python3
"""Every function, method or type a document names in code spans exists in the code (issue 24).

A name in backticks that looks like code -- `Class::member`, `ns::function`, `name()` or
`name(args)` -- must appear in the repository's sources (C++, CUDA, Cap'n Proto schema, CMake):
its last identifier as a word, and for `A::B` forms each qualifier too. Names of other projects
(`kj::`, `std::`, `capnp::`, `cuda...`, system calls) are skipped by prefix or listed below.
Usage: check_doc_names.py ROOT DOC...   Exit 1, listing each stale name with its document and
line, when any is missing.
"""
import pathlib
import re
import sys

SOURCE_SUFFIXES = {".h", ".cc", ".cu", ".cuh", ".capnp", ".cmake", ".txt", ".in", ".py", ".sh"}
SKIP_DIRS = {"build", "build-asan", "build-fuzz", ".git", ".venv", ".device", "vendor", "docs"}
# Qualifiers of names that are not this project's.
FOREIGN = {"kj", "std", "capnp", "nlohmann", "fmt", "spdlog", "CLI", "httplib", "boost", "asio", "beast", "toml", "testing",
           "RpcSystem", "ReaderOptions", "TwoPartyVatNetwork"}  # the last three: Cap'n Proto's
# Calls of the C library, the kernel, CUDA and build tools that documents mention.
EXTERNAL = {
    "poll", "eventfd", "close", "open", "read", "pread", "write", "mmap", "munmap", "madvise",
    "mlock", "fallocate", "fsync", "fdatasync", "memfd_create", "ftruncate", "fcntl", "ioctl",
    "sd_notify", "find_package", "pkg_check_modules", "sched_yield", "epoll_wait", "io_uring_enter",
    "cudaMemcpy", "cudaMemcpyAsync", "cudaHostRegister", "cudaStreamSynchronize", "cudaMalloc",
    "cudaFree", "cudaEventRecord", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMallocHost",
    "malloc", "free", "abort", "exit", "fork", "execve", "kill", "setsid", "getpid", "prctl",
    "recvmsg", "sendmsg", "socket", "accept", "connect", "bind", "listen", "shutdown", "select",
    "posix_fadvise", "readahead", "sync_file_range", "statx", "fstat", "stat", "dup", "dup2",
    "pipe", "pipe2", "signalfd", "timerfd_create", "clock_gettime", "nanosleep", "usleep",
}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# `A::B::c`, `ns::f`, optionally followed by (...)
QUALIFIED = re.compile(r"^([A-Za-z_]\w*(?:::[A-Za-z_]\w*)+)(\(.*\))?$")
# `name()` / `name(args)`
CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$")


def names_in(doc):
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for span in CODE_SPAN.findall(line):
            span = span.strip()
            m = QUALIFIED.match(span)
            if m:
                parts = m.group(1).split("::")
                if parts[0] in FOREIGN:
                    continue
                yield lineno, span, parts
                continue
            m = CALL.match(span)
            if m and m.group(1) not in EXTERNAL and not m.group(1).startswith("cuda"):
                yield lineno, span, [m.group(1)]


def member_of(scope, member, texts):
    """Whether some source defines `scope::member` out of line, or defines the class, struct,
    enum or namespace `scope` and names `member` in the same file."""
    qualified = re.compile(rf"\b{scope}::{member}\b")
    defines = re.compile(rf"\b(class|struct|namespace|enum)\s+(\w+::)*{scope}\b")
    word = re.compile(rf"\b{member}\b")
    return any(qualified.search(t) or (defines.search(t) and word.search(t)) for t in texts)


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = pathlib.Path(sys.argv[1])
    words = set()
    texts = []  # (path, text) of every source
    for path in root.rglob("*"):
        if any(p in SKIP_DIRS for p in path.relative_to(root).parts[:-1]):
            continue
        if not path.is_file():
            continue
        if path.suffix not in SOURCE_SUFFIXES and path.name != "CMakeLists.txt":
            continue
        if "tests" in path.relative_to(root).parts[:1] and path.suffix == ".py":
            continue  # this checker's own lists would make every name exist
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            words.update(re.findall(r"[A-Za-z_]\w*", text))
            texts.append(text)
        except OSError as e:
            print(f"check_doc_names: {path}: {e}", file=sys.stderr)
            return 2
    stale = []
    for doc_name in sys.argv[2:]:
        doc = pathlib.Path(doc_name)
        if not doc.is_file():
            print(f"check_doc_names: {doc}: no such document", file=sys.stderr)
            return 2
        for lineno, span, parts in names_in(doc):
            missing = [p for p in parts if p not in words]
            if missing:
                stale.append(f"{doc}:{lineno}: `{span}`: no {', '.join(missing)} in the code")
            elif len(parts) >= 2 and not member_of(parts[-2], parts[-1], texts):
                stale.append(f"{doc}:{lineno}: `{span}`: {parts[-2]} has no {parts[-1]}")
    if stale:
        print(f"{len(stale)} name(s) in the documents that the code does not have:")
        print("\n".join("  " + s for s in stale))
        return 1
    print(f"check_doc_names: every code name in {len(sys.argv) - 2} document(s) exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
