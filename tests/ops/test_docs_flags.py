"""One meaning per name in the docs: every ``userwise COMMAND ...`` and ``jobs/COMMAND.py ...``
the docs write uses the command's own flags (what its ``--help`` shows), never a flag the
command lacks (an old name, ``--dest``, is one); the Airflow examples use the settings' keys,
not names they never had."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from userwise.pipelines import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "CONTRIBUTING.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
EVERY_COMMAND = {"--json", "--quiet", "--help", "-h"}
# `userwise build ...`, `userwise requests\|history\|window ...` (a table row), `jobs/window.py ...`;
# not `python -m userwise.pipelines...`
CALL = re.compile(r"(?<![\w.-])(?:userwise\s+|jobs/)((?:[a-z]+(?:\\?\|))*[a-z]+)(?:\.py)?\b(.*)")


def shown_flags() -> dict[str, set[str]]:
    """Per command, the option strings its --help shows."""
    sub = next(a for a in cli.parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    out = {}
    for name, sp in sub.choices.items():
        flags = set(EVERY_COMMAND)
        for a in sp._actions:
            flags |= set(a.option_strings)
        out[name] = flags
    return out


def calls(text: str):
    """(line number, commands, flags) of each command call in ``text``, continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    for m in CALL.finditer(joined):
        names = re.split(r"\\?\|", m.group(1))
        rest = re.split(r"`|\s#\s|(?<!\\)\||;|&&|\$\(", m.group(2))[0]  # to the end of the call
        yield joined.count("\n", 0, m.start()) + 1, names, re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_use_each_commands_own_flags(doc):
    flags = shown_flags()
    bad = []
    for line, names, used in calls((ROOT / doc).read_text()):
        names = [n for n in names if n in flags]
        if not names:
            continue  # `userwise` as a word, or a job file that is no command (jobs/probe.py)
        for f in used:
            if not any(f in flags[n] for n in names):
                bad.append(f"{doc}:{line}: {'|'.join(names)} {f}")
    assert bad == []


def test_the_check_finds_an_old_name():
    flags = shown_flags()
    text = ("userwise stage --shards S --node 0 --dest X\n`userwise diagnose --shards DIR` and\n"
            "jobs/pretrain.py --config C \\\n  --date T\n"
            "| `userwise requests\\|history --build-dir D --format a\\|b --output D` | what |\n")
    found = [(names, f) for _, names, used in calls(text) for f in used
             if not any(f in flags[n] for n in names)]
    assert found == [(["stage"], "--dest"), (["diagnose"], "--shards"), (["pretrain"], "--date"),
                     (["requests", "history"], "--format"), (["requests", "history"], "--output")]


OLD_KEYS = re.compile(r"""["'](output|pretrain_days)["']\s*:|^\s*(output|pretrain_days)\s*:""", re.MULTILINE)


@pytest.mark.parametrize("doc", DOCS)
def test_the_airflow_examples_use_the_settings_keys(doc):
    text = (ROOT / doc).read_text()
    assert [m.group(0) for m in OLD_KEYS.finditer(text)] == []


def test_the_commands_guide_lists_every_command():
    text = (ROOT / "docs" / "commands.md").read_text()
    table = text[text.index("## The commands"):text.index("## Output and exit codes")]
    listed = {n for _, names, _ in calls(table) for n in names}
    assert listed == set(cli.COMMANDS)
