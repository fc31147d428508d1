"""The manual holds: README.md and docs/*.md link only to files and headings that exist, every `nemo-jax ...`
command they quote parses with the CLI's own parser, the README's test command is what CI runs, and the
constraints file pins what pyproject.toml asks for. Pure text and argparse (nothing compiles): a second or two.

A command line in a fenced block that must not be parsed (deliberately wrong, say) carries the comment
`# docs-test: skip`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import tomllib
import urllib.parse

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nemo_jax.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = "docs-test: skip"
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}


def doc_files(root=ROOT):
    docs = os.path.join(root, "docs")
    return [os.path.join(root, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


def rel(path, root=ROOT):
    return os.path.relpath(path, root)


def split_blocks(text):
    """(prose lines, fenced blocks): prose as [(line_no, line)] outside fences, blocks as (info, [(line_no, line)])."""
    prose, blocks, fence, info, body = [], [], None, "", []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and m:
            fence, info, body = m.group(1), m.group(2).lower(), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append((info, body))
            fence = None
        elif fence is not None:
            body.append((n, line))
        else:
            prose.append((n, line))
    return prose, blocks


# ---- links -------------------------------------------------------------------------------------------------


def slug(heading):
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every heading anchor of a markdown file (GitHub numbers repeats: x, x-1, x-2)."""
    seen, out = {}, set()
    prose, _ = split_blocks(open(path, encoding="utf-8").read())
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path):
    """[(line_no, target)] of the inline links and images in a file's prose (code spans and blocks skipped)."""
    prose, _ = split_blocks(open(path, encoding="utf-8").read())
    out = []
    for n, line in prose:
        line = re.sub(r"(`+).*?\1", lambda m: " " * len(m.group(0)), line)  # code spans are not links
        out += [(n, m.group(1)) for m in LINK.finditer(line)]
    return out


def bad_links(path, root=ROOT):
    """A message per relative link of `path` whose file or heading does not exist."""
    problems = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), urllib.parse.unquote(file_part))) \
            if file_part else path
        where = f"{rel(path, root)}:{n}: link ({target})"
        if not os.path.exists(dest):
            problems.append(f"{where}: no such file {rel(dest, root)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{where}: {rel(dest, root)} has no heading #{anchor}")
    return problems


def test_every_relative_link_and_anchor_exists():
    problems = [p for f in doc_files() for p in bad_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


# ---- commands ----------------------------------------------------------------------------------------------


def logical_lines(body):
    """(line_no, text) of a code block's lines with backslash continuations joined and a leading `$ ` dropped."""
    out, buf, start = [], "", None
    for n, line in body:
        start = n if start is None else start
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf, start = "", None
    if buf:
        out.append((start, buf))
    return [(n, re.sub(r"^\s*\$\s+", "", t)) for n, t in out]


SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", ">|"}


def commands(line):
    """The argument lists of the `nemo-jax` commands of a shell line: split at && || ; | &, comments and
    redirections dropped; shell variables ($RUN) stay as they are written. Prose that names nemo-jax (an error
    message quoted in a block) is not a command."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    tokens, cmds, cur = list(lex), [], []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in SEPARATORS:
            cmds.append(cur)
            cur = []
        elif t in REDIRECTS or (t.isdigit() and i + 1 < len(tokens) and tokens[i + 1] in REDIRECTS):
            i += 1 if t.isdigit() else 2  # an `N>` pair, or the operator and its target
            continue
        else:
            cur.append(t)
        i += 1
    cmds.append(cur)
    return [c[1:] for c in map(command_words, cmds) if c[:1] == ["nemo-jax"]]


WRAPPERS = {"do", "then", "else", "time", "nohup", "exec", "env"}


def command_words(words):
    """A simple command's words from the program on: leading VAR=value assignments and wrappers (`do`, `time`)
    dropped, and a launcher's command after its `--` (launch/local/run.sh ... -- nemo-jax sft)."""
    while words and (words[0] in WRAPPERS or re.match(r"^[A-Za-z_]\w*=", words[0])):
        words = words[1:]
    if words[:1] != ["nemo-jax"] and "--" in words:
        return command_words(words[words.index("--") + 1:])
    return words


def quoted_commands(path):
    """[(line_no, argv)] of every `nemo-jax` command in the shell code blocks of a markdown file."""
    _, blocks = split_blocks(open(path, encoding="utf-8").read())
    out = []
    for info, body in blocks:
        if info not in SHELL_FENCES:
            continue
        for n, line in logical_lines(body):
            if "nemo-jax" in line and SKIP not in line:
                out += [(n, argv) for argv in commands(line)]
    return out


def strict_parser():
    """The CLI's parser, with abbreviated flags refused: the docs spell every flag out (`--dtyp` would parse)."""
    parser, todo = build_parser(), []
    todo.append(parser)
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        todo += list(subparsers(p).values())
    return parser


def parse_error(argv):
    """None when `nemo-jax ARGV` parses (or is a --help), else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            strict_parser().parse_args(argv)
    except SystemExit as e:
        return None if e.code in (0, None) else (err.getvalue().strip() or f"exit {e.code}")
    return None


def test_every_quoted_command_parses():
    found, problems = 0, []
    for f in doc_files():
        for n, argv in quoted_commands(f):
            found += 1
            msg = parse_error(argv)
            if msg:
                problems.append(f"{rel(f)}:{n}: nemo-jax {shlex.join(argv)}\n    {msg}")
    assert found > 30, f"only {found} quoted commands found: is the block scanner broken?"
    assert not problems, "quoted commands the CLI refuses:\n" + "\n".join(problems)


def test_every_command_in_a_shipped_config_comment_parses():
    """The `#   nemo-jax ...` lines atop configs/*/*.yaml are what a user copies: they parse as the docs' do."""
    import glob

    found, problems = 0, []
    for f in sorted(glob.glob(os.path.join(ROOT, "configs", "*", "*.yaml"))):
        comment = [(n, line.strip()[1:]) for n, line in enumerate(open(f, encoding="utf-8"), 1)
                   if line.lstrip().startswith("#")]
        for n, text in logical_lines(comment):
            text = text.strip()
            if text.startswith("nemo-jax "):
                for argv in commands(text):
                    found += 1
                    msg = parse_error(argv)
                    if msg:
                        problems.append(f"{rel(f)}:{n}: nemo-jax {shlex.join(argv)}\n    {msg}")
    assert found >= 5, f"only {found} commands found in config comments"
    assert not problems, "config comments whose commands the CLI refuses:\n" + "\n".join(problems)


def subparsers(parser):
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def test_inline_commands_name_real_verbs_and_flags():
    """`nemo-jax VERB ... --flag` in prose (usage lines with placeholders, so not parsed whole): the verb exists
    and every --flag is one of its options."""
    problems = []
    for f in doc_files():
        prose, _ = split_blocks(open(f, encoding="utf-8").read())
        for n, line in prose:
            for span in re.findall(r"`(nemo-jax [^`]+)`", line):
                words = span.split()[1:]
                if not re.match(r"^[a-z][a-z-]*$", words[0]):  # `nemo-jax ...`, `nemo-jax VERB`: placeholders
                    continue
                parser, path = build_parser(), []
                while words and words[0] in subparsers(parser):
                    path.append(words[0])
                    parser = subparsers(parser)[words.pop(0)]
                if not path:
                    problems.append(f"{rel(f)}:{n}: `{span}`: no such command")
                    continue
                known = {o for a in parser._actions for o in a.option_strings}
                for w in words:
                    flag = re.match(r"--[a-z0-9][a-z0-9-]*", w)
                    if flag and flag.group(0) not in known:
                        problems.append(f"{rel(f)}:{n}: `{span}`: nemo-jax {' '.join(path)} has no {flag.group(0)}")
    assert not problems, "\n".join(problems)


def test_every_verb_is_in_the_readme_command_table():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    verbs = []
    for name, sub in subparsers(build_parser()).items():
        inner = subparsers(sub)
        verbs += [f"{name} {x}" for x in inner] if inner else [name]
    missing = [v for v in verbs if not re.search(rf"^\| `nemo-jax {re.escape(v)}\b", readme, re.M)]
    assert not missing, f"README's command table lacks: {missing}"


def test_the_checks_catch_a_broken_link_and_a_bad_flag(tmp_path):
    """The scanners above find what they are for (a check that finds nothing proves nothing)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two `words`\n")
    (tmp_path / "README.md").write_text(
        "See [a](docs/a.md#two-words), [gone](docs/gone.md), [no heading](docs/a.md#three) and `[x](not/a/link)`.\n"
        "```bash\n"
        "nemo-jax sft --config c.yaml \\\n    steps=10   # a comment\n"
        "for s in 0 1; do nemo-jax grpo --config g.yaml seed=$s; done && nemo-jax plot $RUN > /dev/null\n"
        "launch/local/run.sh --processes 2 -- nemo-jax sft steps=6\n"
        "export-hf: error: /data/out: 'notes.txt' in it was not written by nemo-jax; move it out first\n"
        "nemo-jax sft --no-such-flag\n"
        "nemo-jax sft --no-such-flag  # docs-test: skip\n"
        "```\n")
    problems = [p for f in doc_files(str(tmp_path)) for p in bad_links(f, str(tmp_path))]
    assert problems == ["README.md:1: link (docs/gone.md): no such file docs/gone.md",
                        "README.md:1: link (docs/a.md#three): docs/a.md has no heading #three"]
    cmds = quoted_commands(str(tmp_path / "README.md"))
    assert [n for n, _ in cmds] == [3, 5, 5, 6, 8]
    assert cmds[0][1] == ["sft", "--config", "c.yaml", "steps=10"]
    assert cmds[1][1] == ["grpo", "--config", "g.yaml", "seed=$s"] and cmds[2][1] == ["plot", "$RUN"]
    assert cmds[3][1] == ["sft", "steps=6"]
    assert [parse_error(argv) is None for _, argv in cmds] == [True, True, True, True, False]
    assert "--no-such-flag" in parse_error(cmds[4][1])
    assert parse_error(["export-hf", "a", "b", "--dtyp", "bf16"])  # an abbreviation argparse would take


# ---- installs ----------------------------------------------------------------------------------------------


def shell_words(line):
    return shlex.split(line, comments=True)


def test_readme_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    _, blocks = split_blocks(readme.split("\n## ", 2)[1])  # the first section: the quick start
    quick = [line for _, body in blocks for _, line in logical_lines(body)]
    test_cmd = [shell_words(line) for line in quick if "pytest" in line]
    assert len(test_cmd) == 1, "the quick start should hold one test command"
    ci = [shell_words(line) for line in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
          if "pytest" in line and not line.lstrip().startswith("#")]
    assert ci == test_cmd, f".ci/run runs {ci}, README says {test_cmd}"
    install = [shell_words(line) for line in quick if "nemo-jax sft" in line]
    assert install and all(w[:4] == ["pip", "install", "-c", "constraints.txt"] for w in install + test_cmd)


def pins():
    out = {}
    for line in open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version and canonicalize_name(name) not in out, f"constraints.txt: {line!r}: want one NAME==VERSION"
            out[canonicalize_name(name)] = version
    return out


def test_constraints_pin_every_dependency_within_its_range():
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    extras = project["optional-dependencies"]
    pinned = pins()
    problems = []
    for req in map(Requirement, project["dependencies"] + [r for e in ("test", "serve", "worker", "mcp", "plot",
                                                                           "wandb", "sandbox") for r in extras[e]]):
        name = canonicalize_name(req.name)
        if name not in pinned:
            problems.append(f"{req} is not pinned")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{req}: the pin {pinned[name]} is outside the range")
    assert not problems, "constraints.txt (tools/maintenance/update_constraints.sh writes it):\n" + "\n".join(problems)
