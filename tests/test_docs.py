"""The docs stay true: README.md and docs/*.md are checked against the code.

- Every relative link resolves to a file, and every `#anchor` to a heading of its page
  under GitHub's slug rules; a page under docs/ links only inside docs/ (the site is built
  from docs/ alone). External http(s) links are not checked.
- Every `emulate ...` line in a bash/sh/shell/console/untyped code block parses with the
  real parsers: `p2p_emulator.cli.resolve` for runs, `p2p_emulator.analysis.report.parse` for `emulate report`,
  and for `emulate sweep` what `emulate sweep` checks before its first run (the grid file
  and every run's settings). A command meant to fail says so where the reader sees it:
  either the line before it is a comment `# fails: WHY`, or the next line is the error it
  prints (`emulate: error: ...`), which must be exactly the parser's.
- A `--config`/`--scenario`/`--grid` file is the repository's, or is shown on the same page
  as a ```yaml block whose first line is `# NAME`. A protocol from another package is known
  to a page's commands when the page declares it: a ```toml block with entry points in the
  group `p2p_emulator.protocols`, and its module as a ```python block starting `# PATH.py`.
- Python blocks run (in a temporary directory, with a time limit), except two kinds, each
  marked by its first line: `# fragment: WHY` (only compiled), and `# excerpt: PATH` (its
  lines must appear in that file of the repository, in order).
- README.md is at most 250 lines.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from p2p_emulator.analysis.output import ArgumentsError
from p2p_emulator.analysis.report import parse as parse_report
from p2p_emulator.analysis.watch import parse as parse_watch
from p2p_emulator import cli
from p2p_emulator.sweeps import GridError, check_settings, load_grid, points
from p2p_emulator.sweeps import parse as parse_sweep
from emulator.errors import UsageError
from emulator.protocol import protocols
from emulator.units import UnitError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250
SHELL = {"", "bash", "sh", "shell", "console"}
SNIPPET_SECONDS = 120

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1")
COMMAND = re.compile(r"^(?:\$ )?(?:emulate|\./dev emulate|\.venv/bin/emulate)(?:\s|$)")
PREFIXES = (["./dev", "emulate"], [".venv/bin/emulate"], ["emulate"])
FILE_FLAGS = ("--config", "--scenario", "--grid")
PYTHON = ("python", "py", "python3")
ENTRY_POINTS = "p2p_emulator.protocols"


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    info: str
    lines: list[str]


def parse_page(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's fenced code blocks, and its other lines (number, text)."""
    blocks, prose, current, indent, fence = [], [], None, "", ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if current is None:
            if match:
                indent, fence = match.group(1), match.group(2)
                current = Block(number, match.group(3).lower(), [])
            else:
                prose.append((number, line))
        elif match and match.group(2)[0] == fence[0] and len(match.group(2)) >= len(fence) and not match.group(3):
            blocks.append(current)
            current = None
        else:
            current.lines.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    if current is not None:
        blocks.append(current)  # unclosed: runs to the end of the page, as Markdown renders it
    return blocks, prose


# --- links and anchors


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the text as rendered (no markup), lowercase,
    punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in parse_page(text)[1]:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code."""
    return [(number, match.group(1)) for number, line in parse_page(text)[1]
            for match in LINK.finditer(INLINE_CODE.sub("", line))]


def link_problems(page: Path, text: str) -> list[str]:
    problems = []
    inside_docs = page.parent.resolve() == DOCS.resolve()
    for number, target in links(text):
        where = f"{page.name}:{number}: {target}"
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # http(s), mailto: not checked
        if not target:
            problems.append(f"{where}: empty link")
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page.resolve()
        if not dest.is_file():
            problems.append(f"{where}: no such file")
            continue
        if inside_docs and not dest.is_relative_to(DOCS.resolve()):
            problems.append(f"{where}: a docs page links outside docs/ (name source files as `code`)")
            continue
        if anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not a page")
            elif unquote(anchor) not in anchors(dest.read_text()):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


# --- emulate commands


@dataclass
class Command:
    line: int
    argv: list[str]
    fails: bool = False  # marked `# fails: ...` on the line before
    error: str | None = None  # the error line shown after it


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with its first line's number."""
    out, pending, start = [], "", 0
    for offset, line in enumerate(block.lines, block.line + 1):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def commands(block: Block) -> list[Command]:
    if block.info not in SHELL:
        return []
    lines = logical_lines(block)
    found = []
    for index, (number, line) in enumerate(lines):
        text = line.strip()
        if not COMMAND.match(text):
            continue
        tokens = shlex.split(text.removeprefix("$ "), comments=True)
        argv = next(tokens[len(p):] for p in PREFIXES if tokens[:len(p)] == p)
        before = lines[index - 1][1].strip() if index else ""
        after = lines[index + 1][1].strip() if index + 1 < len(lines) else ""
        error = after if re.match(r"^emulate(?: report| sweep)?: error:", after) else None
        found.append(Command(number, argv, before.startswith("# fails:"), error))
    return found


def yaml_files(blocks: list[Block]) -> dict[str, str]:
    """Files a page shows: ```yaml blocks whose first line is `# NAME`."""
    return {block.lines[0][1:].strip(): "\n".join(block.lines) + "\n" for block in blocks
            if block.info in ("yaml", "yml") and block.lines and re.match(r"^# \S+\.ya?ml$", block.lines[0])}


def with_files(argv: list[str], shown: dict[str, str], tmp: Path) -> list[str]:
    """argv with each --config/--scenario/--grid file made concrete: the repository's, or the page's."""
    out = list(argv)
    for i, token in enumerate(out):
        flag, eq, value = token.partition("=")
        if flag not in FILE_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(out):
                continue  # the parser reports the missing value
            value = out[i + 1]
        if (ROOT / value).is_file():
            path = ROOT / value
        elif value in shown:
            path = tmp / Path(value).name
            path.write_text(shown[value])
        else:
            raise FileNotFoundError(f"{flag} {value}: neither in the repository nor shown on the page "
                                    f"as a ```yaml block starting '# {value}'")
        if eq:
            out[i] = f"{flag}={path}"
        else:
            out[i + 1] = str(path)
    return out


def page_protocols(blocks: list[Block]) -> tuple[dict[str, type], list[str]]:
    """Protocols a page declares as plugins (see the module docstring), and what is wrong with them."""
    found, problems = {}, []
    for block in blocks:
        if block.info != "toml":
            continue
        try:
            data = tomllib.loads("\n".join(block.lines))
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"line {block.line}: not TOML: {exc}")
            continue
        for name, value in data.get("project", {}).get("entry-points", {}).get(ENTRY_POINTS, {}).items():
            module, _, attribute = value.partition(":")
            path = module.replace(".", "/") + ".py"
            source = next((b for b in blocks if b.info in PYTHON and b.lines and b.lines[0].strip() == f"# {path}"),
                          None)
            if source is None:
                problems.append(f"line {block.line}: plugin {name!r}: no ```python block starting '# {path}'")
                continue
            namespace = types.ModuleType(module)
            sys.modules[module] = namespace  # for dataclasses, while the module runs; never left there
            try:
                exec(compile("\n".join(source.lines), path, "exec", dont_inherit=True), namespace.__dict__)
            finally:
                del sys.modules[module]
            found[name] = getattr(namespace, attribute)
    return found, problems


def parse_error(argv: list[str], plugins: dict[str, type] | None = None) -> str | None:
    """The error line `emulate ARGV` prints before it runs anything, or None if it parses."""
    registry = {**protocols(), **(plugins or {})}
    if argv[:1] == ["report"]:
        try:
            parse_report(argv[1:])
        except ArgumentsError as exc:
            return f"emulate report: error: {exc}"
        return None
    if argv[:1] == ["sweep"]:
        try:  # what `emulate sweep` checks before its first run
            grid = load_grid(Path(parse_sweep(argv[1:]).grid))
            check_settings(grid, points(grid))
        except (ArgumentsError, GridError, UsageError) as exc:
            return f"emulate sweep: error: {exc}"
        return None
    if "--list-protocols" in argv or "--version" in argv:
        return None
    if argv[:1] == ["node"]:  # its flags, and the run's settings it reads
        try:
            cli.cfg.resolve(cli.cfg.read_config_file(cli.node_parser().parse_args(argv[1:]).config), registry)
        except UsageError as exc:
            return f"emulate: error: {exc}"
        return None
    if argv[:1] == ["watch"]:  # a run directory a page's earlier command made
        try:
            parse_watch(argv[1:])
        except ArgumentsError as exc:
            return f"emulate watch: error: {exc}"
        return None
    if argv[:1] == ["merge"]:  # a run directory the nodes wrote
        return None if len(argv) == 2 else "emulate: error: usage: emulate merge RUN_DIR"
    if argv[:1] == ["resume"]:  # a run directory a page's earlier command made
        return None if len(argv) == 2 else "emulate: error: usage: emulate resume RUN_DIR"
    try:
        if "-h" in argv or "--help" in argv:
            named, _ = cli._chosen_protocol([a for a in argv if a not in ("-h", "--help")])
            if named is not None and named not in registry:
                raise UsageError(f"--protocol {named!r}: unknown; choose one of {', '.join(registry)}")
        else:
            cli.resolve(argv, registry)
    except (UsageError, UnitError) as exc:
        return f"emulate: error: {cli.one_line(str(exc))}"
    return None


def command_problems(page: Path, text: str, tmp: Path) -> list[str]:
    blocks, _ = parse_page(text)
    shown = yaml_files(blocks)
    plugins, problems = page_protocols(blocks)
    problems = [f"{page.name}: {problem}" for problem in problems]
    for block in blocks:
        for command in commands(block):
            where = f"{page.name}:{command.line}: emulate {shlex.join(command.argv)}"
            try:
                error = parse_error(with_files(command.argv, shown, tmp), plugins)
            except FileNotFoundError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if command.error is not None:
                if error != command.error:
                    problems.append(f"{where}: the page shows {command.error!r}, the parser says {error!r}")
            elif command.fails:
                if error is None:
                    problems.append(f"{where}: marked '# fails:' but parses")
            elif error is not None:
                problems.append(f"{where}: {error}")
    return problems


# --- Python snippets


def snippets(text: str) -> list[Block]:
    return [block for block in parse_page(text)[0] if block.info in PYTHON]


def excerpt_problem(block: Block, path: str) -> str | None:
    """None when the block's lines (blank ones aside) appear in the file at `path`, in order."""
    source = ROOT / path
    if not source.is_file():
        return f"# excerpt: {path}: no such file in the repository"
    lines = [line.rstrip() for line in source.read_text().splitlines()]
    at = 0
    for line in (line.rstrip() for line in block.lines[1:]):
        if not line.strip():
            continue
        try:
            at = lines.index(line, at) + 1
        except ValueError:
            return f"not in {path} (after its line {at}): {line.strip()!r}"
    return None


def snippet_problem(page: Path, block: Block, tmp: Path) -> str | None:
    where = f"{page.name}:{block.line}"
    code = "\n".join(block.lines) + "\n"
    first = block.lines[0].strip() if block.lines else ""
    if first.startswith("# excerpt:"):  # checked against its file, which the suite runs
        problem = excerpt_problem(block, first.removeprefix("# excerpt:").strip())
        return f"{where}: {problem}" if problem else None
    try:
        compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return f"{where}: not Python: {exc}"
    if first.startswith("# fragment:"):
        return None
    script = tmp / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=SNIPPET_SECONDS)
    except subprocess.TimeoutExpired:
        return f"{where}: ran over {SNIPPET_SECONDS} s (keep snippets small, or mark them '# fragment:')"
    if done.returncode != 0:
        return f"{where}: exit {done.returncode}:\n{done.stderr[-2000:]}"
    return None


# --- the tests on the real pages


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_links_and_anchors_resolve(page):
    assert link_problems(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_emulate_commands_parse(page, tmp_path):
    assert command_problems(page, page.read_text(), tmp_path) == []


SNIPPETS = [(page, block) for page in PAGES for block in snippets(page.read_text())]


@pytest.mark.parametrize("page,block", SNIPPETS, ids=[f"{_id(p)}:{b.line}" for p, b in SNIPPETS])
def test_python_snippets_run(page, block, tmp_path):
    assert snippet_problem(page, block, tmp_path) is None


def test_the_site_builds_strict_with_the_api_reference(tmp_path):
    """mkdocs fails on a broken link or anchor, and mkdocstrings on an API name it cannot find."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    reference = (tmp_path / "api" / "index.html").read_text()
    assert all(f'id="{name}"' in reference for name in ("p2p_emulator.run", "p2p_emulator.Node", "p2p_emulator.sweep"))


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("home", [README, DOCS / "index.md"], ids=_id)
def test_every_page_is_in_the_map(home):
    linked = {(home.parent / target.partition("#")[0]).resolve() for _, target in links(home.read_text())}
    pages = [page for page in PAGES[1:] if page.name != "index.md"]
    assert [page.name for page in pages if page.resolve() not in linked] == []


# --- the checker itself: each check fails where it should


def test_slugs_follow_github():
    assert github_slug("`emulate report`") == "emulate-report"
    assert github_slug("MAPL on FashionMNIST (paper Table 1, CPU scale)") == "mapl-on-fashionmnist-paper-table-1-cpu-scale"
    assert github_slug("Does the graph find the clusters? Seeds and horizons") == \
        "does-the-graph-find-the-clusters-seeds-and-horizons"
    assert github_slug("L2C and meta-L2C") == "l2c-and-meta-l2c"
    assert github_slug("The [node](x.md) API, `node_id`") == "the-node-api-node_id"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}


def test_the_checker_rejects_bad_links(tmp_path):
    page = DOCS / "page-under-test.md"
    text = ("[ok](run-directory.md)\n[gone](no-such-page.md)\n[out](../README.md)\n"
            "[bad anchor](run-directory.md#no-such-heading)\n`[in code](nowhere.md)`\n[web](https://example.org/x)\n")
    problems = link_problems(page, text)
    assert len(problems) == 3, problems
    assert "no such file" in problems[0] and "outside docs/" in problems[1] and "no heading" in problems[2]


def test_the_checker_rejects_bad_commands(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "```bash",
        "emulate --protocol gossip --nodes 4 --rounds 2   # fine",
        "emulate --protocol gossip --no-such-flag 3",
        "emulate --protocol dfedavgm --latency banana",
        "emulate --protocol gossip --topology ring \\",
        "        --nodes many",
        "emulate report",
        "emulate sweep --grid experiments/no_such_grid.yaml",
        "emulate --config no-such.yaml",
        "# fails: this one parses, so the mark is wrong",
        "emulate --protocol gossip",
        "```",
        "```",
        "$ emulate --protocol local --mixing uniform",
        "emulate: error: --mixing: some other message",
        "```",
        "```python",
        "emulate --not-checked-in-python",
        "```",
    ])
    problems = command_problems(page, text, tmp_path)
    assert [p.split(":")[1] for p in problems] == ["3", "4", "5", "7", "8", "9", "11", "14"], problems
    assert "--no-such-flag" in problems[0] and "--nodes" in problems[2]


def test_the_checker_accepts_marked_failures_and_shown_files(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "```yaml", "# my-run.yaml", "protocol: gossip", "nodes: 4", "```",
        "```console",
        "$ emulate --config my-run.yaml --rounds 2",
        "# fails: an option of another protocol",
        "$ emulate --protocol local --mixing uniform",
        "$ emulate --protocol local --mixing uniform",
        "emulate: error: --mixing: not an option of protocol 'local' (it is one of choco, dfedavgm, dpsgd, gossip, powergossip)",
        "$ emulate report runs/A runs/B --partial",
        "$ emulate sweep --grid experiments/mapl_table4.yaml --dry-run",
        "```",
    ])
    assert command_problems(page, text, tmp_path) == []


def test_the_checker_runs_python_and_checks_excerpts(tmp_path):
    failing = Block(1, "python", ["raise SystemExit(3)"])
    assert "exit 3" in snippet_problem(README, failing, tmp_path)
    assert snippet_problem(README, Block(1, "python", ["# fragment: needs a node", "await node.recv()"]), tmp_path) is None
    assert "not Python" in snippet_problem(README, Block(1, "python", ["# fragment: x", "def ("]), tmp_path)
    good = Block(1, "python", ["# excerpt: protocols/push_sum.py", "class PushSum(Protocol):", "",
                               "    async def run(self, node):"])
    assert snippet_problem(README, good, tmp_path) is None
    wrong_order = Block(1, "python", ["# excerpt: protocols/push_sum.py", "    async def run(self, node):",
                                      "class PushSum(Protocol):"])
    assert "not in protocols/push_sum.py" in snippet_problem(README, wrong_order, tmp_path)


def test_the_checker_knows_the_protocols_a_page_declares(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "```toml", '[project.entry-points."p2p_emulator.protocols"]', 'echo = "pkg.mod:Echo"', "```",
        "```python", "# pkg/mod.py", "from dataclasses import dataclass", "from emulator.protocol import Protocol",
        "@dataclass", "class EchoOptions:", "    loud: bool = False", "class Echo(Protocol):",
        "    Options = EchoOptions", "```",
        "```bash", "emulate --protocol echo --loud --nodes 3", "emulate --protocol echo --quiet-ish", "```",
    ])
    problems = command_problems(page, text, tmp_path)
    assert len(problems) == 1 and "--quiet-ish" in problems[0], problems
    assert "echo" not in protocols()  # declared for the page's commands only
