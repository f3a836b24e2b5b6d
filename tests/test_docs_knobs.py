"""docs/server.md's knob table documents every server knob: each CLI flag of `python -m dsv41 serve` (one per
ServeConfig field) and its DSV41_* variable has a row, and each flag a row names exists; README.md links every
docs page (and the headings it links to exist). No model, no server."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from dsv41.serve_config import FIELD_HELP, ServeConfig, build_arg_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "server.md"


def knob_rows() -> list[str]:
    """The table rows of the '## Knobs' section."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Knobs\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `--")]


def cli_flags() -> dict[str, str]:
    """Every long option of the serve parser -> its ServeConfig field (a boolean's `--no-x` included)."""
    flags = {}
    for action in build_arg_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            flags[opt] = action.dest
    return flags


def required_flags() -> dict[str, str]:
    """The flag each field must be documented under: its first option (`--x`; a boolean's `--no-x` is the rule
    stated above the table)."""
    out = {}
    for action in build_arg_parser()._actions:
        if not isinstance(action, argparse._HelpAction):
            out[action.option_strings[0]] = action.dest
    return out


def missing_rows(rows: list[str]) -> list[str]:
    """Flags (or `flag: ENV`) with no row naming the flag in its first column and the env variable in its second."""
    missing = []
    for flag, field in required_flags().items():
        env = "DSV41_" + field.upper()
        row = [r for r in rows if re.search(rf"`{re.escape(flag)}[` ]", r.split("|")[1])]
        if not row:
            missing.append(flag)
        elif not any(f"`{env}`" in r.split("|")[2] for r in row):
            missing.append(f"{flag}: {env}")
    return missing


def test_every_flag_and_env_has_a_row():
    rows = knob_rows()
    assert len(rows) > 20, "the knob table was not found in docs/server.md"
    assert set(FIELD_HELP) == set(ServeConfig.__struct_fields__)
    assert set(required_flags().values()) == set(ServeConfig.__struct_fields__)
    missing = missing_rows(rows)
    assert not missing, f"docs/server.md '## Knobs' has no row for: {missing}"


def test_every_row_names_a_real_flag():
    flags = cli_flags()
    stale = []
    for r in knob_rows():
        for flag in re.findall(r"`(--[a-z0-9-]+)", r.split("|")[1]):
            if flag not in flags:
                stale.append(flag)
    assert not stale, f"docs/server.md documents flags the server does not take: {stale}"


def test_the_check_sees_a_missing_row():
    """The check is not vacuous: a table without the --round-rows row, or with its env cell blanked, is caught."""
    rows = knob_rows()
    assert missing_rows([r for r in rows if not r.startswith("| `--round-rows`")]) == ["--round-rows"]
    blanked = [r.replace("`DSV41_ROUND_ROWS`", "") for r in rows]
    assert missing_rows(blanked) == ["--round-rows: DSV41_ROUND_ROWS"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_every_docs_page_and_its_anchors_exist():
    root = DOC.parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[\w.-]+\.md)(?:#([\w-]+))?\)", readme)
    linked = {page for page, _ in links}
    pages = {f"docs/{p.name}" for p in (root / "docs").glob("*.md")}
    assert pages - linked == set(), f"README.md does not link: {sorted(pages - linked)}"
    for page, anchor in links:
        assert (root / page).is_file(), page
        if anchor:
            heads = re.findall(r"^#+ (.+)$", (root / page).read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in heads}, f"README.md links {page}#{anchor}: no such heading"
