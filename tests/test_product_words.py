"""The product speaks of the product: no work-diary references (an ordinal work session, an issue number) in what
a user or a maintainer reads (README, docs, package, kernels, tests, scripts, examples, dev). History is git's."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACES = ["README.md", "docs", "deepep_portable", "csrc", "tests", "scripts", "examples", "dev"]
DIARY = re.compile(r"\b[a-z-]+(?:th|st|nd|rd) session\b|\bsession \d+\b|\bissue \d+\b|\bissues? #\d+", re.I)
SUFFIXES = (".py", ".md", ".sh", ".cu", ".cuh", ".cc", ".cpp", ".hpp", ".h", ".txt", ".toml")


def _files():
    for place in PLACES:
        path = os.path.join(ROOT, place)
        if os.path.isfile(path):
            yield path
        for dirpath, dirnames, files in os.walk(path):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".pytest_cache")]
            for f in files:
                if f.endswith(SUFFIXES):
                    yield os.path.join(dirpath, f)


def test_no_diary_references_in_the_product():
    hits = []
    for path in _files():
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                if DIARY.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert hits == []


def test_the_pattern_finds_what_it_must():
    session, issue = "session", "issue"   # assembled, so that this file holds no such reference itself
    for text in (f"as in the twenty-first {session}", f"see {issue} 17", f"{session.title()} 4 measured",
                 f"{issue} #3"):
        assert DIARY.search(text), text
    for text in ("a session-scoped fixture", 'scope="session"', "one issue at a time"):
        assert not DIARY.search(text), text
