"""mkdocs hook (mkdocs.yml, ``hooks``): the site serves what the pages link to in the rest of the repository.

The pages link to what they cite where it lies in the repository, so the links work where the pages are read
in the repository; on the site each such link leads to a page that shows the target:

- a folder of the run archive, ``runs/NAME`` from docs/results/ (the archive is excluded from the site):
  the report of those runs, ``results/NAME-report/report.md`` where ``benchmarks/reproduce.sh`` wrote one,
  the leaderboard for the leaderboard's runs, else the report that ``fedpcd report docs/results/runs/NAME``
  prints, made during the build;
- a notebook of notebooks/ (``../notebooks/tutorial.ipynb``): the notebook, executed and rendered by
  mkdocs-jupyter at ``notebooks/NAME/``;
- another repository file outside docs/ (``../configs/example.yaml``): a page with its text.

Any other link to what the site lacks stays as written, and mkdocs' link validation (mkdocs.yml,
``validation``: warn) fails the strict build on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

ARCHIVE = "docs/results/runs"  # exclude_docs in mkdocs.yml
LAST_ROUNDS = 5  # the rounds a generated report averages, as benchmarks/reproduce.sh's reports do
REPORTS = {"leaderboard-fmnist": "leaderboard.md"}  # archives whose report is a page of its own
LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)")  # an inline link's or image's target
LANGUAGES = {".yml": "yaml", ".py": "python", ".sh": "bash"}  # code-block languages; else the suffix

# repository path of a link target (relative to the repository root) -> the page that shows it on the site
_served: dict[str, str] = {}


def _repository_path(page_uri: str, target: str) -> str | None:
    """The repository path a relative link of the page ``page_uri`` (relative to docs/) points at."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
        return None
    return posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), unquote(parts.path)))


def _archive_report(config: MkDocsConfig, files: Files, root: Path, name: str) -> str:
    """The page of the report of the archived runs ``docs/results/runs/NAME``, generated if none is."""
    committed = f"results/{name}-report/report.md"
    if name in REPORTS or files.get_file_from_path(committed) is not None:
        return REPORTS.get(name, committed)
    from fedpcd.report.document import write_report

    folder = f"{ARCHIVE}/{name}"
    text = write_report(root / folder, None, LAST_ROUNDS).replace(f"`{root / folder}`", f"`{folder}`")
    intro = (
        f"Made from the archive when this site was built: `fedpcd report {folder}` prints it, with `--out` "
        "also the runs' curves.\n\n"
    )
    files.append(
        File.generated(
            config, committed, content=f"# Runs: {name}\n\n{intro}{text}", inclusion=InclusionLevel.NOT_IN_NAV
        )
    )
    return committed


def _file_page(config: MkDocsConfig, files: Files, root: Path, path: str) -> str | None:
    """A page with the text of the repository file ``path``; None for what is not UTF-8 text."""
    try:
        text = (root / path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    suffix = Path(path).suffix
    language = LANGUAGES.get(suffix, suffix[1:] or "text")
    content = f"# {path}\n\nThe file `{path}` of the repository.\n\n{fence}{language}\n{text}\n{fence}\n"
    uri = f"repository/{path}.md"
    files.append(File.generated(config, uri, content=content, inclusion=InclusionLevel.NOT_IN_NAV))
    return uri


@event_priority(50)  # before mkdocs-jupyter's on_files, which takes the notebooks added here as pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.docs_dir).resolve().parent  # the repository (docs/ is its docs_dir)
    _served.clear()
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        uri = f"notebooks/{notebook.name}"
        files.append(File(uri, str(root), config.site_dir, config.use_directory_urls))
        _served[uri] = uri
    for page in [f for f in files if f.src_uri.endswith(".md") and f.abs_src_path]:
        for match in LINK.finditer(Path(page.abs_src_path).read_text(encoding="utf-8")):
            path = _repository_path(page.src_uri, match.group(2))
            if path is None or path in _served or not (root / path).exists():
                continue
            if posixpath.dirname(path) == ARCHIVE and (root / path).is_dir():
                _served[path] = _archive_report(config, files, root, posixpath.basename(path))
            elif not path.startswith("docs/") and (root / path).is_file():
                uri = _file_page(config, files, root, path)
                if uri is not None:
                    _served[path] = uri
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def link(match: re.Match[str]) -> str:
        target = match.group(2)
        served = _served.get(_repository_path(page.file.src_uri, target) or "")
        if served is None:
            return match.group(0)
        fragment = urlsplit(target).fragment
        relative = posixpath.relpath(served, posixpath.dirname(page.file.src_uri) or ".")
        return match.group(1) + relative + (f"#{fragment}" if fragment else "")

    return LINK.sub(link, markdown)
