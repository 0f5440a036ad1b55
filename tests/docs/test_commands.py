"""Every command README.md and BENCHMARKS.md show works as written from a fresh clone.

The commands are read from the ``bash`` code blocks of both files. Each must go through
``scripts/dev.sh`` (which sets up ``.venv`` itself), another script of the repository, or ``pip``;
a bare ``python``/``torchrun``/``pytest`` assumes an activated venv and fails. Then each is checked
as far as is cheap: training overrides and benchmark overrides are validated as the scripts
validate them, test paths, scripts and modules must exist, ``pip`` extras must be declared, and
``dev.sh help`` runs. Long runs themselves are not started.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "BENCHMARKS.md")
DEV_SH = ("bash", "scripts/dev.sh")
DEV_SH_COMMANDS = ("train", "test", "bench", "python", "torchrun", "help")
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")

# As when the scripts run: each imports its helpers from its own folder.
sys.path[:0] = [str(REPO / "recipes"), str(REPO / "bench")]


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    argv: tuple[str, ...]
    """The words after any leading ``NAME=value`` environment assignments."""

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.argv)}"


def shown_commands(doc: str) -> list[Command]:
    """The commands of ``doc``'s ``bash`` blocks: comments and blank lines dropped, ``\\`` lines joined."""
    commands, in_bash, pending, start = [], False, "", 0
    for number, line in enumerate((REPO / doc).read_text().splitlines(), start=1):
        fence = line.strip().startswith("```")
        if fence:
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words:
            commands.append(Command(doc, start, tuple(words)))
    return commands


COMMANDS = [command for doc in DOCS for command in shown_commands(doc)]


def test_the_docs_show_commands_through_dev_sh() -> None:
    dev_sh = [c for c in COMMANDS if c.argv[:2] == DEV_SH]
    assert len(dev_sh) >= 20, [str(c) for c in COMMANDS]
    assert {c.argv[2] for c in dev_sh} >= {"train", "test", "bench", "python", "torchrun", "help"}


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_command_needs_no_activated_venv(command: Command) -> None:
    program = command.argv[0]
    if program == "bash":
        assert (REPO / command.argv[1]).is_file(), f"{command}: no such script"
        if command.argv[:2] == DEV_SH:
            assert command.argv[2] in DEV_SH_COMMANDS, f"{command}: dev.sh has no command {command.argv[2]!r}"
    else:
        assert program == "pip", f"{command}: {program!r} needs an activated venv; go through scripts/dev.sh"


def dev_sh_commands(name: str) -> list[Command]:
    return [c for c in COMMANDS if c.argv[:3] == (*DEV_SH, name)]


@pytest.fixture(scope="module")
def train_config_error():
    """recipes/train.py's own check of a command line, in this process."""
    spec = importlib.util.spec_from_file_location("recipe_train", REPO / "recipes" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from train_lib.config import register_configs

    register_configs()
    return train.config_error


@pytest.mark.parametrize("command", dev_sh_commands("train"), ids=str)
def test_training_command_passes_the_recipes_validation(command: Command, train_config_error) -> None:
    args = list(command.argv[3:])
    if "--nproc" in args:  # dev.sh's own flag, as dev.sh parses it
        at = args.index("--nproc")
        assert args[at + 1].isdigit(), command
        del args[at : at + 2]
    resume = [a for a in args if a.startswith("train.resume_from=")]
    if resume:  # names a run of the command before it; checked by tests/recipes
        args.remove(resume[0])
    assert train_config_error(args, world=None) is None, command


@pytest.mark.parametrize("command", dev_sh_commands("bench"), ids=str)
def test_benchmark_command_passes_the_benchmarks_validation(command: Command) -> None:
    from bench_config import BenchConfig

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        job = OmegaConf.to_object(compose("bench", overrides=list(command.argv[3:])))
    assert isinstance(job, BenchConfig), command


def named_paths(args: tuple[str, ...]) -> list[str]:
    """The words that name files or folders of the repository (``tests/x.py::test`` names its file)."""
    return [a.split("::")[0] for a in args if re.match(r"(tests|bench|recipes|docs|scripts)/", a)]


@pytest.mark.parametrize(
    "command", dev_sh_commands("test") + dev_sh_commands("python") + dev_sh_commands("torchrun"), ids=str
)
def test_command_names_files_that_exist(command: Command) -> None:
    args = command.argv[3:]
    if command.argv[2] == "python" and args[0] == "-c":
        compile(args[1], "<-c>", "exec")
        return
    if command.argv[2] == "python" and args[0] == "-m":
        assert importlib.util.find_spec(args[1]) is not None, command
        return
    named = named_paths(args)
    assert named or args == ("--quick",) or not args, command
    assert all((REPO / path).exists() for path in named), command


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[0] == "pip"], ids=str)
def test_pip_installs_name_declared_extras(command: Command) -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    target = command.argv[-1]
    assert command.argv[1:3] == ("install", "-e") and target.startswith("."), command
    named = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", target)
    assert named is not None, command
    assert set(filter(None, (named.group(1) or "").split(","))) <= extras, command


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (REPO / ".venv").resolve(),
    reason="scripts/dev.sh sets up the checkout's .venv; run only from that interpreter",
)
def test_dev_sh_help_lists_every_command() -> None:
    proc = subprocess.run([*DEV_SH, "help"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for name in DEV_SH_COMMANDS:
        assert f"bash scripts/dev.sh {name}" in proc.stdout, name
