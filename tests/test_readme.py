"""The README is true: its two set-up-and-go commands are the ones CI runs, its settings table matches
train_fsdp2.py's settings block, and every link in the docs reaches a file and heading that exist.
(tests/test_train_fsdp1.py runs README's `accelerate launch` command.) No process is launched."""

import ast
import os
import re

from conftest import ROOT

DOCS = ["README.md", "BENCHMARKS.md", "tests/README.md", "bench/README.md"] + [
    os.path.join(folder, name) for folder in ("docs", os.path.join("bench", "reports"))
    for name in sorted(os.listdir(os.path.join(ROOT, folder))) if name.endswith(".md")
]


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_gives_two_set_up_and_go_commands_and_ci_runs_the_test_one():
    setup = [block for block in bash_blocks(read("README.md")) if block.startswith("pip install")]
    assert len(setup) == 2, setup
    run, tests = setup
    assert run.endswith("torchrun --nproc_per_node=2 train_fsdp2.py"), run
    assert "-r requirements.txt -c constraints.txt" in run, run
    assert "-r requirements-test.txt -c constraints.txt" in tests, tests
    assert tests.endswith("python -m pytest -q -n 2 --dist loadfile tests"), tests
    ci = [line.strip() for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert tests in ci, f".ci/run must run README's test command exactly: {tests}"
    assert tests in bash_blocks(read("tests/README.md")), "tests/README.md shows another test command"


def requirement_names(path: str) -> set[str]:
    names = set()
    for line in read(path).splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_constraints_pin_every_requirement():
    pinned = {}
    for line in read("constraints.txt").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pinned[name.lower().replace("_", "-")] = version
    missing = (requirement_names("requirements.txt") | requirement_names("requirements-test.txt")) - set(pinned)
    assert not missing, f"constraints.txt pins no version of {sorted(missing)}"
    assert "-r requirements.txt" in read("requirements-test.txt")
    assert "pytest" not in requirement_names("requirements.txt"), "pytest belongs in requirements-test.txt"


def script_settings(path: str) -> dict:
    """The module-level `name = <literal>` assignments of a script, read without running it."""
    settings = {}
    for node in ast.parse(read(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.islower():
                try:
                    settings[name] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return settings


def test_readme_settings_table_matches_train_fsdp2():
    section = read("README.md").split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \|", section, re.M)
    assert len(rows) > 10, "the settings table was not found"
    settings = script_settings("train_fsdp2.py")
    for name, default in rows:
        assert name in settings, f"README's settings table names {name!r}, which train_fsdp2.py does not have"
        assert ast.literal_eval(default) == settings[name], (
            f"README says {name} defaults to {default}, train_fsdp2.py to {settings[name]!r}"
        )


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_docs_reaches_an_existing_file_and_heading():
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", read(doc), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(ROOT, path)):
                broken.append(f"{doc}: {target} (no file {path})")
            elif fragment:
                headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", read(path), flags=re.S), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    broken.append(f"{doc}: {target} (no heading #{fragment} in {path})")
    assert not broken, "\n".join(broken)


def test_every_command_in_the_current_docs_names_a_file_and_variant_that_exist():
    """README, BENCHMARKS.md, docs/, tests/README.md and bench/README.md give commands people run today (the dated
    reports in bench/reports/ keep the commands of their day): each bench/ or tests/ file they name exists, and each
    `bench/run.py VARIANT` is a variant of the harness."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import VARIANTS

    missing = []
    for doc in [d for d in DOCS if not d.startswith(os.path.join("bench", "reports"))]:
        text = read(doc)
        for path in set(re.findall(r"(?<![\w/.])((?:bench|tests)/[\w/.-]*\w)", text)):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
        for name in re.findall(r"bench/run\.py (\w+)", text):
            if name not in VARIANTS and name != "VARIANT":
                missing.append(f"{doc}: bench/run.py {name} (no such variant)")
    assert not missing, "\n".join(sorted(missing))


def test_no_pointer_to_a_readme_section_that_moved():
    """Messages and docstrings point at docs/*.md, not at README sections that moved there."""
    moved = ("Bad input", "Supported models", "megablocks backend", "Non-finite steps", "Collective timeouts",
             "Several nodes", "Checkpoints, resume", "Pictures", "The CPU trap", "GPU results")
    stale = []
    for folder in ("megablocks_utils", "tests", "bench", "tools", "."):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith((".py", ".sh", ".txt", ".yaml")) and name != "test_readme.py":
                for number, line in enumerate(read(os.path.join(folder, name)).splitlines(), 1):
                    if "README" in line and any(section in line for section in moved):
                        stale.append(f"{folder}/{name}:{number}: {line.strip()}")
    assert not stale, "\n".join(stale)


def test_benchmarks_is_a_current_page():
    """BENCHMARKS.md keeps today's numbers with their commands (at most 250 lines); dated reports live in bench/reports/."""
    text = read("BENCHMARKS.md")
    assert len(text.splitlines()) <= 250
    assert text.split("\n## ", 2)[1].startswith("Headline"), "the headline table comes first"
    assert not re.search(r"session|\bcall [A-Z0-9]\b", text, re.I), re.search(r".{40}(session|\bcall [A-Z0-9]\b).{40}", text, re.I)
    assert os.listdir(os.path.join(ROOT, "bench", "reports"))
