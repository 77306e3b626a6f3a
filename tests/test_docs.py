"""The docs cite what exists: every link and cited repository path resolves, and docs/runs holds raw
logs only, uncompressed (no lock files, archives or compressed files, scripts or checkpoints)."""
import glob
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_READMES = sorted((REPO / "docs" / "runs").rglob("README.md"))
NOT_RAW_LOGS = (".lock", ".tgz", ".tar", ".gz", ".xz", ".zip", ".py", ".pt", ".ckpt", ".safetensors", ".bin")
TOP_LEVEL = ("model/", "kernels/", "training/", "data/", "scripts/", "tests/", "configs/", "docs/", "train.py",
             "errors.py", "requirements")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`]*`", re.S)
CITED = re.compile(r"`([^`\s]+)`")
FILE = re.compile(r"\.(md|log|txt|json|jsonl|csv|png|py|sh|yaml|gz|tgz|lock|rc|pt)$|/$")


def tracked(folder: Path) -> list[str]:
    """Files git tracks under ``folder`` (relative to the repository), or every file there without git."""
    try:
        out = subprocess.run(["git", "ls-files", str(folder.relative_to(REPO))], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(REPO)) for p in folder.rglob("*") if p.is_file()]


def exists(base: Path, cited: str, anywhere: bool = False) -> bool:
    """Whether ``cited`` (a path, a glob, or {a,b} alternatives) names something under ``base``;
    with ``anywhere``, in any folder below it."""
    braces = re.search(r"\{([^}]*)\}", cited)
    if braces:
        return all(exists(base, cited[:braces.start()] + alt + cited[braces.end():], anywhere)
                   for alt in braces.group(1).split(","))
    pattern = base / "**" / cited if anywhere else base / cited
    return bool(glob.glob(str(pattern), recursive=anywhere))


def ignored(path: str) -> bool:
    """Whether git ignores ``path``: a user's own file (configs/local/), which docs may name."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def missing_links(doc: Path) -> list[str]:
    """Relative link targets of ``doc`` (outside code) that do not exist."""
    targets = [t.split("#")[0] for t in LINK.findall(CODE.sub("", doc.read_text()))]
    return [t for t in targets if t and not re.match(r"[a-z]+:", t) and not exists(doc.parent, t)]


def missing_citations(doc: Path, run_folder: bool) -> list[str]:
    """Paths ``doc`` cites in backticks that do not exist: repository paths (from the root), and in
    a run folder's README also the files of that folder (found in any folder below it, or in the
    repository: the README names them as its table's commands do)."""
    missing = []
    for span in CITED.findall(doc.read_text()):
        path = re.split(r"::|:\d", span)[0].rstrip(".,;")
        if "<" in path or "$" in path or "=" in path:
            continue  # a placeholder, a variable or an option
        if path.startswith(TOP_LEVEL):
            if not exists(REPO, path) and not ignored(path):
                missing.append(span)
        elif run_folder and FILE.search(path) and not (exists(doc.parent, path, anywhere=True)
                                                        or exists(REPO, path, anywhere=True)):
            missing.append(span)
    return missing


def test_docs_runs_holds_no_locks_tarballs_scripts_or_checkpoints():
    offenders = [path for path in tracked(REPO / "docs" / "runs") if path.endswith(NOT_RAW_LOGS)]
    assert offenders == []


@pytest.mark.parametrize("doc", DOCS + RUN_READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    assert missing_links(doc) == []


@pytest.mark.parametrize("doc", DOCS + RUN_READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_file_exists(doc):
    assert missing_citations(doc, run_folder=doc in RUN_READMES) == []


def test_every_cited_test_exists():
    """A test named in the docs (RELIABILITY.md's table, KERNEL.md) is a test file or a test function."""
    defined = set(re.findall(r"^\s*def (test_\w+)", "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py")),
                             re.M))
    files = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    cited = {name for doc in DOCS for name in re.findall(r"\b(test_\w+)", doc.read_text())}
    assert sorted(cited - defined - files) == []
