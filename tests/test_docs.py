"""The documentation stays true to the code: docs/reference.md is what the parsers print, every
`eagle-*` command line in a fenced shell block uses flags its command knows, and every relative
link in README.md and docs/ reaches a file (and, into a Markdown file, one of its headings)."""
from __future__ import annotations

import importlib.util
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
COMMAND = re.compile(r"^(?:\S*/)?(eagle-[a-z-]+)$")


def _load_gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_reference = _load_gen_reference()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def split_fences(text: str) -> tuple[list[tuple[str, list[tuple[int, str]]]], list[tuple[int, str]]]:
    """(fenced blocks as (info, [(line number, line)]), the lines outside any fence)."""
    blocks, prose, current, marker = [], [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if current is None and fence:
            marker, current = fence.group(1), (fence.group(2).lower(), [])
        elif current is not None and line.strip().startswith(marker):
            blocks.append(current)
            current = None
        elif current is not None:
            current[1].append((number, line))
        else:
            prose.append((number, line))
    return blocks, prose


def command_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A shell block's logical lines (backslash continuations joined), with their first line number."""
    out, pending, start = [], "", 0
    for number, line in block:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def flags_of(line: str) -> tuple[str, list[str]] | None:
    """(command, the option strings it is given) for a line that starts with an eagle-* command."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like text: read it word by word
        words = line.split("#", 1)[0].split()
    if not words or not (match := COMMAND.match(words[0])):
        return None
    name, words = match.group(1), words[1:]
    if words[:1] == ["serve"] and f"{name} serve" in gen_reference.commands():
        name, words = f"{name} serve", words[1:]
    flags = []
    for word in words:
        if word in {"|", "||", "&&", ";", "&"} or word.startswith((">", "<", "2>")):
            break  # the rest of the line is another command or a redirection
        if word == "--":
            break  # the rest goes to the program the command runs (eagle-triton-serve: tritonserver)
        word = word.strip("[]")
        if word.startswith("-") and word != "-" and not re.fullmatch(r"-[\d.]+", word):
            flags.append(word.split("=", 1)[0])
    return name, flags


@cache
def known_flags(name: str) -> frozenset[str]:
    return frozenset(gen_reference.parser_of(name)._option_string_actions)


def test_reference_is_current():
    expected = gen_reference.render()
    current = gen_reference.REFERENCE.read_text() if gen_reference.REFERENCE.exists() else ""
    assert current == expected, "docs/reference.md is out of date: run python scripts/gen_reference.py"


def test_reference_covers_every_script():
    scripts = gen_reference.commands()
    for name in ("eagle-export", "eagle-run", "eagle-train", "eagle-eval", "eagle-bench", "eagle-validate",
                 "eagle-serve", "eagle-triton-repo", "eagle-triton-serve"):
        assert name in scripts, name
        assert "--help" in known_flags(name)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_shell_examples_use_known_flags(doc):
    unknown = []
    blocks, _ = split_fences(doc.read_text())
    for info, block in blocks:
        if info not in SHELL_FENCES:
            continue
        for number, line in command_lines(block):
            found = flags_of(line.strip())
            if found is None:
                continue
            name, flags = found
            if name not in gen_reference.commands():
                unknown.append(f"{_rel(doc)}:{number}: {name} is no command of pyproject.toml")
                continue
            unknown += [f"{_rel(doc)}:{number}: {name} has no flag {flag}"
                        for flag in flags if flag not in known_flags(name)]
    assert not unknown, "\n".join(unknown)


def test_flag_checker_sees_an_unknown_flag():
    """The checker itself catches a bad flag, a bad subcommand flag and a continued line."""
    block = [(1, "eagle-run --engines DIR \\"), (2, "    --no-such-flag 3   # a comment --ignored"),
             (3, "eagle-bench serve --url $URL --concurrency 1,2 [--bogus]"), (4, "echo eagle-run --x")]
    found = [flags_of(line) for _, line in command_lines(block)]
    assert found[0] == ("eagle-run", ["--engines", "--no-such-flag"])
    assert found[1] == ("eagle-bench serve", ["--url", "--concurrency", "--bogus"])
    assert found[2] is None
    assert "--no-such-flag" not in known_flags("eagle-run") and "--url" in known_flags("eagle-bench serve")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    _, prose = split_fences(path.read_text())
    for _, line in prose:
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc):
    broken = []
    _, prose = split_fences(doc.read_text())
    for number, line in prose:
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{_rel(doc)}:{number}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{_rel(doc)}:{number}: {target} (no such heading in {file.name})")
    assert not broken, "\n".join(broken)
