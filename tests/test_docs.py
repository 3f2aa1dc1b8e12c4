"""The repository's documents stand alone: every citation points at a document the repository holds.

Checked in every tracked file and every untracked file git does not ignore (text files only; binary files
such as safetensors and images are skipped):
  * no mention of the `shared` folder beside the checkout (the path is spelt SHARED below);
  * every token ending in `.md` (a bare name or a path) names a file of the repository, relative to the root
    or to the citing file's folder (web addresses are not citations of repository documents);
  * every section mark (the sign SECTION followed by a number, ranges included) has a `.md` token before it
    on the same line, the nearest of which is the document it cites, and that document has a heading with
    that number ("## 3. Title" or "### 3.2 Title").
The sign and the folder are built from pieces so that this file passes its own check.
"""
import os
import re
import subprocess
from functools import lru_cache
from typing import Callable, Dict, Iterable, List, Optional, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "\u00a7"
SHARED = ".." + "/shared"
MD = "." + "md"

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
MD_TOKEN = re.compile(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*\.md)(?![\w-])")
NUMBER = r"(\d+(?:\.\d+)*)"
SECTION_REF = re.compile(SECTION + r"\s*" + NUMBER                                    # a number,
                         + r"(?:\s*[-\u2013]\s*(?:" + SECTION + r"\s*)?" + NUMBER + ")?")  # or a range
HEADING = re.compile(r"^#{1,6}\s+" + NUMBER + r"\.?(?:\s|$)")


def repository_files(root: str = ROOT) -> List[str]:
    """Tracked files plus untracked files that git does not ignore (paths relative to root), less those of a
    virtual environment made inside the clone under any name (a folder holding pyvenv.cfg: its packages'
    documents are not ours; Python before 3.13 writes no .gitignore into it)."""
    listed = []
    for extra in ([], ["--others", "--exclude-standard"]):
        out = subprocess.run(["git", "ls-files", "-z", *extra], cwd=root, capture_output=True, check=True)
        found = [p for p in out.stdout.decode("utf-8").split("\0") if p]
        if extra:
            venvs = [os.path.dirname(p) for p in found if os.path.basename(p) == "pyvenv.cfg"]
            found = [p for p in found if not any(p.startswith(v + "/") or p == os.path.join(v, "pyvenv.cfg")
                                                 for v in venvs)]
        listed += found
    return sorted(set(listed))


def read_text(path: str) -> Optional[str]:
    """The file's text, or None for binary files (a NUL byte, or not UTF-8) and files that are gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def headings(text: str) -> Set[str]:
    """Section numbers of a Markdown text's headings, fenced code blocks excluded."""
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.add(m.group(1))
    return found


def line_problems(line: str, folder: str, resolve: Callable[[str, str], Optional[str]],
                  sections: Callable[[str], Set[str]]) -> List[str]:
    """What is wrong with one line of a file in `folder` (relative to the root); [] if nothing."""
    problems = []
    if SHARED in line:
        problems.append(f"mentions {SHARED}, which is outside the repository")
    text = URL.sub(" ", line)
    tokens = [(m.start(), m.group(1)) for m in MD_TOKEN.finditer(text)]
    docs = {}
    for _, token in tokens:
        docs[token] = resolve(token, folder)
        if docs[token] is None:
            problems.append(f"cites {token}, which is not a file of the repository")
    for m in SECTION_REF.finditer(text):
        before = [token for pos, token in tokens if pos < m.start()]
        if not before:
            problems.append(f"{m.group(0).strip()} without a {MD} document of the repository before it on "
                            f"the line")
            continue
        doc = docs[before[-1]]
        if doc is None:
            continue   # already reported
        for number in filter(None, m.groups()):
            if number not in sections(doc):
                problems.append(f"{before[-1]} has no section {number}")
    return problems


def check_files(root: str, files: Iterable[str]) -> List[str]:
    """'path:line: problem' for every problem in the given files (paths relative to root)."""
    files = sorted(files)
    known = {os.path.normpath(f) for f in files}

    def resolve(token: str, folder: str) -> Optional[str]:
        for base in ("", folder):
            path = os.path.normpath(os.path.join(base, token))
            if path in known and os.path.isfile(os.path.join(root, path)):
                return path
        return None

    @lru_cache(maxsize=None)
    def sections(doc: str) -> Set[str]:
        return headings(read_text(os.path.join(root, doc)) or "")

    problems = []
    for rel in files:
        text = read_text(os.path.join(root, rel))
        if text is None:
            continue
        folder = os.path.dirname(rel)
        for n, line in enumerate(text.splitlines(), 1):
            problems += [f"{rel}:{n}: {p}" for p in line_problems(line, folder, resolve, sections)]
    return problems


# ---------------------------------------------------------------------------------------------------------
# The repository
# ---------------------------------------------------------------------------------------------------------

def test_repository_cites_only_its_own_documents():
    problems = check_files(ROOT, repository_files())
    assert not problems, f"{len(problems)} citation problem(s):\n" + "\n".join(problems[:40])


def test_docs_exist_with_numbered_sections():
    docs = [f for f in repository_files() if f.startswith("docs/") and f.endswith(MD)]
    assert {f"docs/{name}{MD}" for name in ("architecture", "numerics", "checkpoint", "cli")} <= set(docs)
    for doc in docs:
        text = read_text(os.path.join(ROOT, doc))
        fenced, top = False, 0
        for line in text.splitlines():
            if line.startswith("```"):
                fenced = not fenced
            if fenced or not re.match(r"^#{2,3} ", line):
                continue
            m = re.match(r"^## (\d+)\. \S", line) or re.match(r"^### (\d+)\.\d+ \S", line)
            assert m, f"{doc}: unnumbered heading {line!r}"
            if line.startswith("## "):
                assert int(m.group(1)) == top + 1, f"{doc}: {line!r} does not follow section {top}"
                top += 1
            else:
                assert int(m.group(1)) == top, f"{doc}: {line!r} is not inside section {top}"


def test_readme_lists_every_doc():
    readme = read_text(os.path.join(ROOT, "README" + MD))
    for doc in (f for f in repository_files() if f.startswith("docs/") and f.endswith(MD)):
        assert doc in readme, f"README does not list {doc}"


# ---------------------------------------------------------------------------------------------------------
# The checker itself, on a made-up repository
# ---------------------------------------------------------------------------------------------------------

S = SECTION
FAKE_DOCS: Dict[str, str] = {
    "docs/guide" + MD: "# Guide\n\n## 1. Start\n\n### 1.2 Detail\n\n```\n## 9. not a heading\n```\n\n"
                       "## 2. End\n",
    "tests/data/README" + MD: "# Data\n\n## 8. Tolerances\n\n### 8.2 Tight\n",
}


def fake_check(tmp_path, line: str, where: str = "code.py") -> List[str]:
    files = dict(FAKE_DOCS, **{where: line + "\n"})
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return check_files(str(tmp_path), files)


@pytest.mark.parametrize("line, reason", [
    ("# rounding as in numerics " + S + "11", "without a"),
    ("# (see modules" + MD + " " + S + "8, numerics " + S + "12)", "not a file of the repository"),
    ('"""See cli' + MD + ' for the flags."""', "not a file of the repository"),
    ("# the flags of docs/guide" + MD + " " + S + "3", "has no section 3"),
    ("# docs/guide" + MD + " " + S + "1.2-" + S + "1.3", "has no section 1.3"),
    ("# fenced text is no section: docs/guide" + MD + " " + S + "9", "has no section 9"),
    ("# the fixture README " + S + "8", "without a"),
    ("FIX = '" + SHARED + "/fixtures/reference-tiny'", "outside the repository"),
    ("# " + S + "1 of docs/guide" + MD, "without a"),
])
def test_checker_catches_a_bad_line(tmp_path, line, reason):
    problems = fake_check(tmp_path, line)
    assert problems and all(p.startswith("code.py:1: ") for p in problems), problems
    assert any(reason in p for p in problems), problems


@pytest.mark.parametrize("line, where", [
    ("# docs/guide" + MD + " " + S + "1, " + S + "1.2 and " + S + "2", "code.py"),
    ("# docs/guide" + MD + " " + S + "1-2", "code.py"),
    ("# tests/data/README" + MD + " " + S + "8.2 (a file of the repository, its own numbering)", "code.py"),
    ("see README" + MD + " " + S + "8 beside this file", "tests/data/notes.txt"),
    ("the folder ../reference-tiny/ holds the weights; the section sign alone: " + S, "code.py"),
    ("upstream: https://example.com/org/repo/blob/main/README" + MD, "code.py"),
])
def test_checker_accepts_a_good_line(tmp_path, line, where):
    assert fake_check(tmp_path, line, where) == []


def test_headings_ignore_fenced_blocks():
    assert headings(FAKE_DOCS["docs/guide" + MD]) == {"1", "1.2", "2"}


def test_a_virtual_environment_in_the_clone_is_not_read(tmp_path):
    """`python -m venv anyname` inside the clone (untracked, not ignored): its files are left out; other
    untracked files are still read."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README.md").write_text("# x\n")
    subprocess.run(["git", "add", "README.md"], cwd=tmp_path, check=True)
    env = tmp_path / "myenv"
    (env / "lib").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (env / "lib" / "METADATA").write_text("a package's own notes\n")
    (tmp_path / "notes.txt").write_text("notes\n")
    assert repository_files(str(tmp_path)) == ["README.md", "notes.txt"]
