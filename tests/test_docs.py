"""The documentation's links and the code's citations of it resolve, inside the repository.

- Every relative link of README.md, docs/*.md, results/README.md and notebooks/README.md
  (outside code) names a file or folder of the repository, and its ``#anchor`` a heading of the
  target (GitHub's slugs) or an explicit ``<a id="...">``.
- Every ``docs/<page>.md#<anchor>`` and every repository path (``upipe/chunked.py``,
  ``results/emulate_vs_allocator/``, ...) that the code's docstrings and comments cite exists,
  the anchor as a heading of the page.
- No tracked file cites the design notes that used to live outside the repository.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md",
        ROOT / "notebooks" / "README.md"]
CODE_DIRS = ("upipe", "baselines", "experiments", "benchmarks", "scripts", "tests", "examples")
CODE = sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))
# the names of the notes outside the repository, spelled so that this file does not match
OUTSIDE = ("DESIGN" + ".md", "STYLE" + ".md", ".." + "/shared", "shared" + "/reference")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
# a docs page and anchor, or a path under one of the repository's top-level folders
DOC_ANCHOR = re.compile(r"docs/[\w.-]+\.md(?:#[\w-]+)?")
TOPS = "upipe|baselines|experiments|benchmarks|scripts|tests|examples|results|docs|notebooks"
REPO_PATH = re.compile(rf"(?<![\w./-])(?:{TOPS})/[\w./-]*[\w/]")
# a cited path that is not this repository's: FlashAttention's own test file (its tolerance rule)
NOT_OURS = {"tests/test_flash_attn.py"}
OUTPUT_FLAGS = ("--out ", "--out=")  # a path after these is what a command writes, not a citation


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation but '-' and '_'
    dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a markdown file offers: its headings' slugs (repeats numbered, as GitHub
    does) and explicit ``<a id>`` targets."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set(HTML_ID.findall(text))
    for heading in HEADING.findall(text):
        s = slug(heading)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def unresolved(target: str, base: Path, root: Path = ROOT) -> str | None:
    """Why the relative link ``target`` does not resolve, or None. ``base``: the folder a path
    is relative to, or the page itself for a bare ``#anchor``."""
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve() if path else base
    if not dest.exists():
        return "no such file"
    if root.resolve() not in (dest, *dest.parents):
        return "outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {dest.relative_to(root.resolve())}"
    return None


def links(doc: Path) -> list[str]:
    """The relative link targets of a markdown file, outside code blocks and inline code."""
    text = INLINE_CODE.sub("", FENCE.sub("", doc.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slugs_follow_github():
    assert slug("The main job: run_all.sh") == "the-main-job-run_allsh"
    assert slug("UPipe's options") == "upipes-options"
    assert slug("One node to 8M (beyond the paper)") == "one-node-to-8m-beyond-the-paper"
    assert slug("`plan`, [the CLI](x.md)") == "plan-the-cli"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Its part\n\n```\n# not a heading\n```\n")
    assert unresolved("page.md#its-part", tmp_path, root=tmp_path) is None
    assert unresolved("#a-page", page, root=tmp_path) is None
    why = unresolved("page.md#no-part", tmp_path, root=tmp_path)
    assert why == "no heading #no-part in page.md"
    assert unresolved("page.md#not-a-heading", tmp_path, root=tmp_path) is not None
    assert unresolved("missing.md", tmp_path, root=tmp_path) == "no such file"
    assert unresolved("../page.md", tmp_path / "sub", root=tmp_path / "sub") is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = [f"{t}: {why}" for t in links(doc)
           if (why := unresolved(t, doc if t.startswith("#") else doc.parent))]
    assert not bad, f"{doc.relative_to(ROOT)}: links that do not resolve:\n" + "\n".join(bad)


def _prose(path: Path) -> str:
    """The docstrings and comments of a Python file."""
    src = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_code_cites_docs_and_paths_that_exist():
    bad = []
    for path in CODE:
        prose = _prose(path)
        for cite in DOC_ANCHOR.findall(prose):
            if why := unresolved(cite, ROOT):
                bad.append(f"{path.relative_to(ROOT)}: {cite}: {why}")
        for m in REPO_PATH.finditer(prose):
            cited = m.group().rstrip(".")
            if cited in NOT_OURS or prose[:m.start()].endswith(OUTPUT_FLAGS) or (
                    prose[m.end():m.end() + 1] in ("{", "*", "<")):  # a pattern, not a path
                continue
            module = re.sub(r"\.\w+$", "", cited) + ".py"  # a module's attribute: a.b.NAME
            if not (ROOT / cited).exists() and not (ROOT / module).exists():
                bad.append(f"{path.relative_to(ROOT)}: {cited}: no such file")
    assert not bad, "citations that do not resolve:\n" + "\n".join(sorted(set(bad)))


def _tracked() -> list[Path]:
    """The repository's tracked files (every file but build outputs without git)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0")
        return [ROOT / n for n in names if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "__pycache__"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def test_nothing_cites_notes_outside_the_repository():
    bad = []
    for path in _tracked():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary (plots), or deleted in the working tree
        bad += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)
