"""Regenerate the sample outputs in README.md and docs/*.md from the commands that print them.

Each sample sits between two markers that name its command::

    <!-- output: memest estimate torchvision.models:resnet18 --input-shape 3,224,224 --batch-size 8 -->
    ```
    ...what the command prints...
    ```
    <!-- /output -->

and :data:`SAMPLES` says, for each such command, which part of its output is shown and what in it depends
on the machine. Usage, from anywhere:

    python benchmarks/readme_outputs.py                # run every command, rewrite its blocks
    python benchmarks/readme_outputs.py --check        # exit 1, with a diff, where a block is stale
    python benchmarks/readme_outputs.py --only "memest estimate ..."   # one command (repeatable)
    python benchmarks/readme_outputs.py --file docs/cli.md             # one document (repeatable)

Each command runs once, however many documents show it. The commands run from the repository root in one
fixed environment (:data:`ENV`: the CPU with no GPU visible, 2 threads, the kernel models of one
instruction set, a terminal 80 columns wide; and, for the main example, no ``rich``, as the README's
set-up command installs it), so that the estimates on fake tensors print the same bytes on any machine.
What still depends on the machine is masked when comparing (seconds everywhere; in a fit, the kernels
calibrated on this machine and the measured peaks), and rewritten as it comes. ``tests/test_readme.py``
compares the README against the output of the same runs (:func:`stale`), so a sample that no longer
matches fails the tests.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The documents whose samples are checked: the README and every page of docs/.
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")))

#: The environment every sample runs in: what would make the output differ between machines, fixed.
ENV = {
    "CUDA_VISIBLE_DEVICES": "",  # the samples are of CPU runs, also on a machine with a GPU
    "OMP_NUM_THREADS": "2",  # some CPU kernel models scale with the thread count
    "MEMEST_CPU_ISA": "avx512",  # the hand-written kernel models of one instruction set, whatever the CPU
    "COLUMNS": "80",  # the summary's width, rich's tables and wrapping
    "KINETO_LOG_LEVEL": "6",  # the profiler's chatter (stderr)
}

#: Seconds anywhere in an output ("estimated in 0.85 s", "added 1.07 s").
SECONDS = r"\d+(?:\.\d+)? s\b"
MASK = "…"


@dataclass(frozen=True)
class Sample:
    """A README sample: the command that prints it, as the README's marker names it."""

    command: str
    #: The parts shown, as (first line, last line) regular expressions, joined by a "..." line; empty:
    #: the whole output.
    keep: tuple[tuple[str, str], ...] = ()
    #: Regular expressions (multi-line mode, ``.`` not matching newlines unless ``(?s:...)``) of what
    #: depends on the machine beyond :data:`SECONDS`: masked when comparing.
    machine: tuple[str, ...] = ()
    #: Without ``rich`` (``tests/no_rich`` on ``PYTHONPATH``): what ``pip install -e ".[vision]"`` gives.
    no_rich: bool = False
    #: stdout and stderr as one terminal shows them (in order; of each line, what follows its last
    #: carriage return): where the output is Lightning's, on both streams beside a progress bar.
    terminal: bool = False

    def environment(self) -> dict[str, str]:
        """The variables the command runs with, on top of the caller's."""
        extra = dict(ENV)
        if self.no_rich:
            path = [str(ROOT / "tests" / "no_rich"), str(ROOT), os.environ.get("PYTHONPATH", "")]
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        return extra


SAMPLES = (
    Sample(
        "python examples/train_classifier.py",
        keep=(
            (r"^  \| Name", r"^0 \| model"),
            (r"^Estimated peak memory, first step", r"^For batches of shapes"),
            (r"^MemEstimate \(", r"^  step 2: "),
        ),
        # The callback calibrates kernel memory on this machine (its default), and measures real steps.
        machine=(
            r"(?<=^Estimated peak memory, first step \(cpu\): ).*$",
            r"(?<=^Estimated peak memory, steady state: ).*$",
            r"^At the steady-state peak:(?s:.*?)(?=^For batches)",
            r"(?<=^  step \d: ).*$",
        ),
        no_rich=True,
        terminal=True,
    ),
    Sample("memest estimate torchvision.models:resnet18 --input-shape 3,224,224 --batch-size 8"),
    Sample(
        'memest plan tests.models:TinyGPT --model-kwargs \'{"n_layers": 12, "d_model": 256, '
        '"vocab": 1000, "seq_len": 128}\' --tokens 128 --vocab 1000 --batch-size 8 --budget 256MiB'
    ),
    Sample("memest plan torchvision.models:resnet50 --input-shape 3,224,224 --batch-size 32 --budget 2GiB"),
)

BLOCK = re.compile(
    r"^<!-- output: (?P<command>.+?) -->\n```\n(?P<text>.*?)\n?```\n<!-- /output -->$", re.M | re.S
)


def sample(command: str) -> Sample:
    for s in SAMPLES:
        if s.command == command:
            return s
    raise KeyError(f"no sample for {command!r} in benchmarks/readme_outputs.py's SAMPLES")


def blocks(readme: str) -> dict[str, str]:
    """The README's sample blocks: command -> the text shown."""
    return {m["command"]: m["text"] for m in BLOCK.finditer(readme)}


def screen(output: bytes) -> str:
    """What a terminal shows of ``output``: of each line, the text after its last carriage return (a
    progress bar redraws itself with them)."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in output.decode(errors="replace").split("\n"))


def execute(s: Sample, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``s.command`` run from the repository root in its environment (on top of ``env``, else this
    process's): stdout is what the sample shows (with stderr, as a terminal shows both, for a
    :attr:`Sample.terminal` one)."""
    done = subprocess.run(
        s.command,
        shell=True,
        cwd=ROOT,
        env={**(os.environ if env is None else env), **s.environment()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if s.terminal else subprocess.PIPE,
        executable="/bin/bash",
    )
    stdout = screen(done.stdout) if s.terminal else done.stdout.decode()
    return subprocess.CompletedProcess(done.args, done.returncode, stdout, (done.stderr or b"").decode())


def run(s: Sample) -> str:
    """What ``s.command`` prints (see :func:`execute`)."""
    done = execute(s)
    if done.returncode != 0:
        raise RuntimeError(
            f"{s.command} exited with {done.returncode}:\n{(done.stderr or done.stdout)[-4000:]}"
        )
    return done.stdout


def excerpt(s: Sample, stdout: str) -> str:
    """The part of ``stdout`` the README shows: trailing spaces stripped, the kept parts joined by "..."."""
    lines = [line.rstrip() for line in stdout.splitlines()]
    if not s.keep:
        return "\n".join(lines).strip("\n")
    parts = []
    for first, last in s.keep:
        start = next((i for i, line in enumerate(lines) if re.search(first, line)), None)
        if start is None:
            raise ValueError(f"{s.command}: no line matches {first!r} in its output:\n{stdout}")
        end = next((i for i in range(start, len(lines)) if re.search(last, lines[i])), None)
        if end is None:
            raise ValueError(
                f"{s.command}: no line matches {last!r} after {first!r} in its output:\n{stdout}"
            )
        parts.append("\n".join(lines[start : end + 1]))
    return "\n...\n".join(parts)


def masked(s: Sample, text: str) -> str:
    for pattern in (SECONDS, *s.machine):
        text = re.sub(pattern, MASK, text, flags=re.M)
    return text


def stale(s: Sample, shown: str, printed: str) -> str | None:
    """A unified diff of the README's text against the excerpt printed now, both masked; None if equal."""
    a, b = masked(s, shown).splitlines(), masked(s, printed).splitlines()
    if a == b:
        return None
    return "\n".join(difflib.unified_diff(a, b, "shown", s.command, lineterm=""))


def rewrite(readme: str, command: str, text: str) -> str:
    """``readme`` with the block of ``command`` holding ``text``."""
    found = [m for m in BLOCK.finditer(readme) if m["command"] == command]
    if len(found) != 1:
        raise ValueError(f"the document has {len(found)} output blocks for {command!r}, not one")
    m = found[0]
    return readme[: m.start("text")] + text + "\n" + readme[m.end("text") :].lstrip("\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 if stale")
    parser.add_argument("--only", action="append", metavar="COMMAND", help="this sample's command only")
    parser.add_argument(
        "--file",
        "--readme",
        action="append",
        type=Path,
        dest="files",
        metavar="FILE",
        help="a document to read and rewrite (repeatable; default: README.md and docs/*.md)",
    )
    args = parser.parse_args()

    files = args.files or list(DOCUMENTS)
    shown = {f: blocks(f.read_text()) for f in files}
    every = {c for b in shown.values() for c in b}
    unknown = sorted(every - {s.command for s in SAMPLES})
    if unknown:
        parser.error(f"output blocks with no sample here: {unknown}")
    chosen = [sample(c) for c in args.only] if args.only else [s for s in SAMPLES if s.command in every]
    for s in chosen:
        if s.command not in every:
            parser.error(f"no output block for {s.command!r} in {', '.join(map(str, files))}")
    failed = 0
    printed: dict[str, str] = {}
    for s in chosen:
        print(f"== {s.command}", file=sys.stderr, flush=True)
        printed[s.command] = excerpt(s, run(s))  # once, for every document that shows it
        for f, found in shown.items():
            if s.command in found:
                diff = stale(s, found[s.command], printed[s.command])
                if diff:
                    print(f"{f}:\n{diff}")
                    failed += 1
    if args.check:
        print(f"{failed} stale sample block(s)", file=sys.stderr)
        return 1 if failed else 0
    # Read again: the runs take a while, and the documents may have been edited meanwhile.
    for f in files:
        text = f.read_text()
        for command, out in printed.items():
            if command in blocks(text):
                text = rewrite(text, command, out)
        f.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
