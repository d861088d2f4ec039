"""The README and the pages of docs/ are true: every command and every Python block in them runs, their
sample outputs are what their commands print now, and what they name exists. (Below, "the documents":
README.md and docs/*.md, read as one text; a command given in two of them runs once.)

* ``bash`` blocks: each command (backslash continuations joined, a trailing ``# comment`` dropped, the
  halves of ``a && b`` taken apart) runs in a shell from the repository root, exactly as written, and
  must exit 0. The same for the commands written in the prose (code spans that start with ``python``,
  ``bash``, ``pip`` or ``tensorboard``), and for each example the prose names (``examples/X.py`` runs as
  ``python examples/X.py``). The exceptions are :data:`NOT_RUN`, each with its reason, and, on a
  machine without a GPU, :data:`NEEDS_GPU` (CUDA what-ifs such as ``--device cuda`` estimates do run).
* Benchmarks (``benchmarks/X.py``, ``benchmarks/X.sh``, wherever the README names one, in a command or
  not; the GPU's ``gpu_session.sh`` and ``cuda_validation.py`` among them) take minutes each, so none
  runs in full here, with or without a GPU: each runs with ``--help`` only and must exit 0,
  print its usage and list every flag the README gives it -- a renamed script, a broken import or a
  dropped flag fails. (The Python ones run in one interpreter, one after another, each as
  ``python benchmarks/X.py --help`` runs it: its own folder first on ``sys.path``, as ``__main__``, its
  ``SystemExit`` status as the exit status. One interpreter start instead of one per script.)
* ``python`` blocks: each runs as ``python -`` (the block on stdin, as if pasted) from the repository
  root, and must exit 0. None is exempt: each block is a whole program.
* Plain blocks are sample outputs, not run. Those between ``<!-- output: COMMAND -->`` markers must be
  what COMMAND prints now, in the environment ``benchmarks/readme_outputs.py`` fixes, the figures that
  depend on the machine masked; that script rewrites them (tested here on a copy of the README).
* Every file the documents name exists (with the package's files in the layout of
  docs/how-it-works.md), every link between them leads to a file, every flag of the CLI synopsis is
  one ``memest COMMAND --help`` lists, and every ``lightning_memest.x.y`` they name imports.
* The README stays a landing page: at most 250 lines, linking every page of docs/; and no document
  speaks of the project's history (internal run labels such as "session 5"; that is the CHANGELOG's).

The runs go two at a time (this project's CI machine has two cores), all started with the module's first
test, longest first; each test waits for its own. ``pytest -s`` prints each run's seconds (136-183 s
for the whole file on two cores shared with other work; the main example, one epoch of 16 steps,
33-42 s, is the longest).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Each document's text, the README first.
DOCUMENTS = {p: p.read_text() for p in (README, *sorted((ROOT / "docs").glob("*.md")))}
README_TEXT = DOCUMENTS[README]
#: The documents as one text, for what is checked alike in each.
TEXT = "\n\n".join(DOCUMENTS.values())
TIMEOUT_S = 600

#: Commands the README gives that do not run here, by a regular expression matched at the command's
#: start, with the reason. Each must still match a command of the README (a test checks that).
NOT_RUN = {
    r"pip install ": "installs the project: CI installs it itself, with the README's own command (.ci/run)",
    r"python -m pytest": "the test suite itself: .ci/run runs it, and checks the README gives that command",
    r"tensorboard --logdir ": (
        "a server that runs until stopped; tests/test_tensorboard.py reads a real run through a real "
        "TensorBoard server's routes"
    ),
}

#: Commands that need a GPU, by regular expression, with the reason: run only where torch sees one.
#: (What-ifs such as ``memest estimate ... --device cuda`` are not among them: they run on any CPU.)
NEEDS_GPU = {
    r"memest (measure|compare) .*--device cuda": "measures real CUDA steps",
}


def _load_readme_outputs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_outputs", ROOT / "benchmarks" / "readme_outputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


outputs = _load_readme_outputs()
SAMPLES = {s.command: s for s in outputs.SAMPLES}


# ------------------------------------------------------------------------------------- reading README

FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


def fenced(lang: str) -> list[str]:
    return [m["body"] for m in FENCE.finditer(TEXT) if m["lang"] == lang]


def code_spans() -> list[str]:
    """The inline code of the prose (fenced blocks left out), whitespace runs made single spaces."""
    prose = FENCE.sub("", TEXT)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(block: str) -> list[str]:
    """The commands of a ``bash`` block: continuations joined, comments dropped, ``&&`` taken apart."""
    commands, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.strip()[:-1].rstrip() + " "
            continue
        command = strip_comment(pending + line.strip())
        pending = ""
        commands += [part.strip() for part in command.split(" && ") if part.strip()]
    return commands


def readme_commands() -> list[str]:
    """Every command of the README, in order, once: the ``bash`` blocks', the prose's, the examples'."""
    found = [c for block in fenced("bash") for c in shell_commands(block)]
    found += [s for s in code_spans() if re.match(r"(python|bash|pip|tensorboard) ", s)]
    found += [f"python {p}" for p in re.findall(r"(?<![\w/])(examples/\w+\.py)", TEXT)]
    # Once each: the same command spelt with other spaces (aligned in a block) is the same run.
    unique: dict[str, str] = {}
    for command in found:
        unique.setdefault(command if "'" in command or '"' in command else " ".join(command.split()), command)
    return list(unique.values())


def benchmark_flags() -> dict[str, list[str]]:
    """Every benchmark script the README names, with the flags it gives it anywhere."""
    flags: dict[str, list[str]] = {}
    for text in [*code_spans(), *(c for b in fenced("bash") for c in shell_commands(b))]:
        for path, rest in re.findall(r"(?<![\w/])(benchmarks/\w+\.(?:py|sh))((?: [^ ]+)*)", text):
            flags.setdefault(path, [])
            flags[path] += [f for f in re.findall(r"(?<!\S)--[\w-]+", rest) if f not in flags[path]]
    return flags


def not_run(command: str) -> str | None:
    for pattern, reason in NOT_RUN.items():
        if re.match(pattern, command):
            return reason
    if not torch.cuda.is_available():
        for pattern, reason in NEEDS_GPU.items():
            if re.match(pattern, command):
                return f"needs a GPU ({reason})"
    return None


def is_benchmark(command: str) -> bool:
    return re.match(r"(python|bash) benchmarks/", command) is not None


# ---------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def report(self) -> str:
        return (
            f"exit {self.returncode} after {self.seconds:.1f} s\n"
            f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-6000:]}"
        )


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    # `python`, `memest` and `tensorboard` are this interpreter's, as in an activated environment.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, **(extra or {})}


def shell(command: str, *, stdin: str | None = None, env: dict[str, str] | None = None) -> Done:
    start = time.perf_counter()
    done = subprocess.run(
        command, shell=True, cwd=ROOT, input=stdin, capture_output=True, text=True,
        env=environment(env), timeout=TIMEOUT_S, executable="/bin/bash",
    )  # fmt: skip
    return Done(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


# Runs each script as `python SCRIPT --help` would, one after another in this one interpreter.
HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
results = {}
base = [p for p in sys.path if p not in ("", os.getcwd())]
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv, sys.path[:] = [script, "--help"], [os.path.dirname(os.path.abspath(script)), *base]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException as error:
        code, out = 1, io.StringIO(f"{out.getvalue()}{type(error).__name__}: {error}")
    results[script] = [code, out.getvalue()]
print(json.dumps(results))
"""


def help_of_benchmarks(scripts: list[str]) -> dict[str, Done]:
    python = [s for s in scripts if s.endswith(".py")]
    done = shell("python - " + " ".join(python), stdin=HELP_RUNNER)
    assert done.returncode == 0, done.report()
    results = {s: Done(code, out, "", done.seconds) for s, (code, out) in json.loads(done.stdout).items()}
    for script in scripts:
        if script.endswith(".sh"):
            results[script] = shell(f"bash {script} --help")
    return results


@dataclass(frozen=True)
class Job:
    """One run, shared by the tests that need it."""

    key: str
    run: Callable[[], Any]
    first: bool = False  # a long one: started before the others


COMMANDS = readme_commands()
BENCHMARKS = benchmark_flags()
PYTHON_BLOCKS = fenced("python")


def sample_run(command: str) -> Done:
    """A sample's command, run as ``readme_outputs.py`` runs it (its environment; stdout and stderr as
    one terminal shows them where the sample says so)."""
    start = time.perf_counter()
    done = outputs.execute(SAMPLES[command], env=environment())
    return Done(done.returncode, done.stdout, done.stderr or "", time.perf_counter() - start)


def command_job(command: str) -> Job:
    # A sample's run is also its comparison's.
    run = (lambda: sample_run(command)) if command in SAMPLES else (lambda: shell(command))
    return Job(f"$ {command}", run, first="examples/train_classifier" in command)


def python_job(index: int) -> Job:
    return Job(f"python block {index}", lambda: shell("python -", stdin=PYTHON_BLOCKS[index]))


#: Every benchmark script, named in the README or not: each must at least start.
ALL_BENCHMARKS = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")
)
HELP_JOB = Job("--help of the benchmarks", lambda: help_of_benchmarks(ALL_BENCHMARKS))


class Runs:
    """Runs jobs two at a time, each once."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, Future[Any]] = {}

    def start(self, job: Job) -> None:
        if job.key not in self.futures:
            self.futures[job.key] = self.pool.submit(job.run)

    def result(self, job: Job) -> Any:
        self.start(job)
        return self.futures[job.key].result()


def _selected_jobs(items: list[pytest.Item]) -> list[Job]:
    jobs = []
    for item in items:
        if item.module is sys.modules[__name__] and hasattr(item, "callspec"):
            jobs += [v for v in item.callspec.params.values() if isinstance(v, Job)]
    return sorted(jobs, key=lambda job: not job.first)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Runs]:
    logs = ROOT / "lightning_logs"
    before = set(logs.glob("version_*")) | set(logs.glob("*/version_*"))
    existed = logs.exists()
    runs = Runs()
    for job in _selected_jobs(request.session.items):
        runs.start(job)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)
    # What the example and the Trainer block logged (lightning_logs/ is ignored by git): only this run's.
    if not existed:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        for version in (set(logs.glob("version_*")) | set(logs.glob("*/version_*"))) - before:
            shutil.rmtree(version, ignore_errors=True)


def _report(done: Done, what: str) -> None:
    print(f"\n{done.seconds:6.1f} s  {what}")  # pytest -s shows them


# ---------------------------------------------------------------------------------------------- tests

RUN = [c for c in COMMANDS if not_run(c) is None and not is_benchmark(c)]
SKIPPED = [c for c in COMMANDS if not_run(c) is not None]


@pytest.mark.parametrize("job", [command_job(c) for c in RUN], ids=RUN)
def test_readme_command_runs_as_written(runs: Runs, job: Job) -> None:
    done = runs.result(job)
    _report(done, job.key)
    assert done.returncode == 0, f"{job.key}\n{done.report()}"


@pytest.mark.parametrize("command", SKIPPED)
def test_readme_command_not_run(command: str) -> None:
    pytest.skip(f"{command}: {not_run(command)}")


def test_every_exception_is_a_readme_command() -> None:
    for pattern in NOT_RUN:
        assert any(re.match(pattern, c) for c in COMMANDS), f"NOT_RUN's {pattern!r} matches no README command"
    assert RUN, "no README command found to run"


@pytest.mark.parametrize("job", [python_job(i) for i in range(len(PYTHON_BLOCKS))], ids=lambda j: j.key)
def test_readme_python_block_runs(runs: Runs, job: Job) -> None:
    done = runs.result(job)
    _report(done, job.key)
    block = PYTHON_BLOCKS[int(job.key.split()[-1])]
    assert done.returncode == 0, f"```python\n{block}```\n{done.report()}"


@pytest.mark.parametrize("script", ALL_BENCHMARKS)
@pytest.mark.parametrize("job", [HELP_JOB], ids=["help"])
def test_benchmark_answers_help(runs: Runs, job: Job, script: str) -> None:
    # Every script, so that one the README does not name cannot rot unseen (kernel_sweep.py imported
    # a name that had moved); those it names list the flags it gives them.
    done = runs.result(job)[script]
    _report(done, f"{script} --help" + (" (with the other Python benchmarks)" * script.endswith(".py")))
    assert done.returncode == 0, f"{script} --help\n{done.report()}"
    assert "usage:" in done.stdout, f"{script} --help prints no usage:\n{done.stdout}"
    for flag in BENCHMARKS.get(script, []):
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", done.stdout), (
            f"the README gives {script} {flag}, which its --help does not list:\n{done.stdout}"
        )


def test_readme_benchmark_commands_are_checked() -> None:
    for command in filter(is_benchmark, COMMANDS):
        assert command.split()[1] in BENCHMARKS, command


# ------------------------------------------------------------------------------------ sample outputs


@pytest.mark.parametrize("job", [command_job(c) for c in SAMPLES], ids=list(SAMPLES))
def test_readme_sample_output_is_what_the_command_prints(runs: Runs, job: Job) -> None:
    command = job.key.removeprefix("$ ")
    shown = {
        path: outputs.blocks(text)[command]
        for path, text in DOCUMENTS.items()
        if command in outputs.blocks(text)
    }
    assert shown, f"no document has a <!-- output: {command} --> block"
    assert command in COMMANDS, f"the documents show the output of {command} but never give the command"
    done = runs.result(job)
    assert done.returncode == 0, done.report()
    printed = outputs.excerpt(SAMPLES[command], done.stdout)
    for path, text in shown.items():  # one run, compared with every document that shows it
        diff = outputs.stale(SAMPLES[command], text, printed)
        assert diff is None, (
            f"{path.relative_to(ROOT)}'s output of {command} is stale "
            f"(python benchmarks/readme_outputs.py):\n{diff}"
        )


def test_every_readme_sample_has_its_command() -> None:
    shown = {c for text in DOCUMENTS.values() for c in outputs.blocks(text)}
    assert shown == set(SAMPLES), "output blocks and readme_outputs.SAMPLES differ"


REGENERATED = "memest estimate torchvision.models:resnet18 --input-shape 3,224,224 --batch-size 8"


def _regenerate() -> tuple[Done, str]:
    """``readme_outputs.py`` run on a copy of the README whose sample of REGENERATED is stale: what it
    printed, and the copy afterwards."""
    with tempfile.TemporaryDirectory(prefix="memest-readme-") as folder:
        copy = Path(folder) / "README.md"
        copy.write_text(outputs.rewrite(README_TEXT, REGENERATED, "stale"))
        done = shell(f"python benchmarks/readme_outputs.py --readme {copy} --only '{REGENERATED}'")
        return done, copy.read_text()


@pytest.mark.parametrize("job", [Job("readme_outputs.py on a stale copy", _regenerate)], ids=["regenerate"])
def test_readme_outputs_script_rewrites_a_stale_sample(runs: Runs, job: Job) -> None:
    done, rewritten = runs.result(job)
    _report(done, job.key)
    assert done.returncode == 0, done.report()
    assert "-stale" in done.stdout  # the diff it shows
    sample = SAMPLES[REGENERATED]
    assert outputs.masked(sample, outputs.blocks(rewritten)[REGENERATED]) == outputs.masked(
        sample, outputs.blocks(README_TEXT)[REGENERATED]
    )
    assert rewritten.replace(outputs.blocks(rewritten)[REGENERATED], "") == README_TEXT.replace(
        outputs.blocks(README_TEXT)[REGENERATED], ""
    ), "the script changed more than the block"


# ---------------------------------------------------------------------------------- what README names


def test_every_file_the_readme_names_exists() -> None:
    # (docs/api.md is the docstrings, which name torch's files too.)
    prose = "\n\n".join(t for p, t in DOCUMENTS.items() if p != ROOT / "docs" / "api.md")
    named = set(re.findall(r"(?<![\w/.~<-])(?:\./)?((?:[\w-]+/)+[\w.-]+\.(?:py|md|sh|png|json|toml))", prose))
    assert len(named) > 10
    missing = [p for p in named if not (ROOT / p).exists() and not (ROOT / "lightning_memest" / p).exists()]
    assert not missing, f"the documents name files that do not exist: {sorted(missing)}"


def test_every_link_leads_to_a_file() -> None:
    # Markdown links and pictures, relative to the document that has them (web addresses aside).
    broken = []
    for path, text in DOCUMENTS.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            file = target.split("#")[0]
            if file and not re.match(r"\w+://", file) and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_is_a_landing_page() -> None:
    lines = README_TEXT.count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the details to docs/"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README_TEXT))
    pages = {p.name for p in DOCUMENTS if p.parent.name == "docs"}
    assert pages and pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"


def test_no_document_tells_the_project_s_history() -> None:
    # Internal run labels and earlier runs' figures belong in CHANGELOG.md, not in the documents.
    labels = r"\bsessions? \d+|\(session\b|session \d+'s|\bround \d+\b|an earlier run\b|earlier runs read"
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path, text in DOCUMENTS.items()
        for m in re.finditer(labels, text, re.I)
    ]
    assert not found, found


def test_every_file_of_the_readme_layout_exists() -> None:
    tree = next(b for b in fenced("") if b.startswith("lightning_memest/\n"))
    listed, folders = [], []
    for line in tree.splitlines()[1:]:
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        folders = folders[: indent // 2 - 1]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            listed.append(Path("lightning_memest", *folders, name))
    assert len(listed) > 30
    missing = [str(p) for p in listed if not (ROOT / p).is_file()]
    assert not missing, f"the layout (docs/how-it-works.md) lists files that do not exist: {missing}"
    # And the other way: a module of the package that the layout does not list is a concept a reader
    # cannot find by its file name.
    package = {p.relative_to(ROOT) for p in (ROOT / "lightning_memest").rglob("*.py")}
    unlisted = sorted(str(p) for p in package - set(listed) if p.name != "__init__.py")
    assert not unlisted, f"modules missing from the layout of docs/how-it-works.md: {unlisted}"


def _synopsis() -> list[tuple[list[str], list[str]]]:
    """The CLI synopsis: (the words after ``memest`` that name the command, the flags it shows)."""
    block = next(b for b in fenced("") if b.startswith("memest estimate MODEL"))
    entries: list[str] = []
    for line in block.splitlines():
        if line.startswith("memest "):
            entries.append(line)
        else:
            entries[-1] += " " + line
    parsed = []
    for entry in entries:
        words = entry.split()
        command = [] if words[1].startswith("--") else [words[1]]
        shown = re.sub(r"\(the [^)]*\)", "", entry)  # a remark in words ("(the flags of estimate but ...)")
        parsed.append((command, re.findall(r"(?<![\w-])--[a-z][\w-]*", shown)))
    return parsed


def test_every_flag_of_the_cli_synopsis_exists(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_memest.cli import main

    synopsis = _synopsis()
    assert {c[0] for c, _ in synopsis if c} >= {"estimate", "measure", "compare", "max-batch-size", "profile"}
    for command, flags in synopsis:
        try:
            code = main([*command, "--help"])
        except SystemExit as exit:  # argparse's --help, where main lets it through
            code = exit.code
        assert code == 0
        help_text = capsys.readouterr().out
        for flag in flags:
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", help_text), (
                f"the README's synopsis gives `memest {' '.join(command)} {flag}`: not in its --help"
            )


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_name_the_readme_gives_exists() -> None:
    from lightning_memest import StepEstimate

    dotted = {m for s in code_spans() for m in re.findall(r"^lightning_memest(?:\.\w+)+", s)}
    assert len(dotted) >= 3
    for name in sorted(dotted):
        _resolve(name)  # raises where the README names what is not there
    fields = {f.name for f in dataclasses.fields(StepEstimate)}
    for attr in {m for s in code_spans() for m in re.findall(r"^StepEstimate\.(\w+)", s)}:
        assert attr in fields or hasattr(StepEstimate, attr), f"README names StepEstimate.{attr}"


def test_the_api_reference_is_what_its_script_writes() -> None:
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "benchmarks" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.page()
    assert (
        "### `lightning_memest.MemEstimate`" in written and "### `lightning_memest.estimate_step`" in written
    )
    assert DOCUMENTS[ROOT / "docs" / "api.md"] == written, (
        "docs/api.md is stale: python benchmarks/api_reference.py"
    )
