"""The product speaks of the product: no work-diary references ("the twelfth session", "issue 17") in what a
user or a maintainer reads (README, docs, package, kernels, tests, scripts, examples, dev). History is git's."""
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
    me = os.path.abspath(__file__)
    hits = []
    for path in _files():
        if os.path.abspath(path) == me:
            continue
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                if DIARY.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert hits == []


def test_the_pattern_finds_what_it_must():
    for text in ("as in the twenty-first session", "see issue 17", "Session 4 measured", "issue #3"):
        assert DIARY.search(text), text
    for text in ("a session-scoped fixture", 'scope="session"', "one issue at a time"):
        assert not DIARY.search(text), text
