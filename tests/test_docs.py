"""The docs cannot drift from the tasks: every task of the namespace (tasks.py, the one `railyard` and `inv` share)
has its section in its docs page, with every flag; every link between README.md and docs/ lands; the README stays
a page a new user reads in five minutes."""

from __future__ import annotations

import re

from .conftest import ROOT
from .test_tasks import every_task, namespace

DOCS = ROOT / "docs"
OWN_PAGE = {"rdma-test": "rdma-test.md", "roll": "roll.md"}   # a page of its own, the task's flags anywhere in it


def page_of(task: str) -> str:
    return OWN_PAGE.get(task) or ("lab.md" if task.startswith("lab.") else "tasks.md")


def section(text: str, task: str) -> str | None:
    """The text under `### `TASK``, to the next heading of that level or above."""
    m = re.search(rf"^### `{re.escape(task)}`\n(.*?)(?=^#{{1,3}} |\Z)", text, re.M | re.S)
    return m.group(1) if m else None


def flags(task) -> list[str]:
    return [a.names[0].upper() if a.positional else "--" + a.names[0] for a in task.get_arguments()]


def missing_from_docs() -> list[str]:
    out = []
    for name, task in every_task(namespace()):
        page = page_of(name)
        text = (DOCS / page).read_text()
        where = text if name in OWN_PAGE else section(text, name)
        if where is None or name not in text:
            out.append(f"docs/{page}: no section ### `{name}`")
            continue
        out += [f"docs/{page}: {name}: {f} not documented" for f in flags(task)
                if not re.search(rf"`{re.escape(f)}[ `=]", where)]
    return out


def test_every_task_and_flag_is_on_its_docs_page():
    assert not missing_from_docs(), "\n".join(missing_from_docs())


def test_the_check_sees_a_missing_flag(monkeypatch):
    """Not blind: a flag taken out of a task's section is named."""
    text = (DOCS / "tasks.md").read_text()
    cut = text.replace("- `--dry-run`: print the inventory instead of writing it\n", "")
    assert cut != text
    real_read = type(DOCS).read_text
    monkeypatch.setattr(type(DOCS), "read_text",
                        lambda self, *a, **k: cut if self == DOCS / "tasks.md" else real_read(self, *a, **k))
    assert "docs/tasks.md: discover: --dry-run not documented" in missing_from_docs()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#+ (.+)$", text, re.M):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def test_every_link_between_readme_and_docs_lands():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_links_every_reference_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in readme, page.name
    # the two commands it promises, and the stage names bin/test runs
    assert "bin/lab-demo" in readme and "bin/test" in readme
    stages = re.search(r"^stages=\((.*)\)$", (ROOT / "bin" / "test").read_text(), re.M).group(1).split()
    assert stages == ["unit", "lab", "real"] and all(f"`{s}`" in readme for s in stages)
