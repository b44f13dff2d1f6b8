"""Runs the code blocks of the docs, so that an example cannot rot.

Pages: ``docs/*.md``, ``packages/*/README.md`` and ``README.md``. The rules (CI enforces them):

- Every ```` ```python ```` block is a complete program: it runs as written, in a fresh Python
  process, in an empty folder of its own (but for the page's earlier ``file`` blocks, below),
  and must exit 0 within its timeout (120 s unless tagged). Multi-process examples start their peers themselves, or are a file plus
  the command that launches it (below).
- A block is tagged by an HTML comment on the line just before its fence, invisible on GitHub
  and in the Sphinx build: ``<!-- example: WORDS -->``. The words:

  - ``gpu``: the block needs a CUDA GPU; CPU CI leaves it out and ``ci/device/doc_examples.sh``
    runs it on the device machine (``python ci/doc_examples.py --gpu``);
  - ``file NAME``: the block is not run but saved as ``NAME`` in the page's folder, for the blocks
    after it (a script, or CUDA source a script reads);
  - ``run``: a shell block (```` ```bash ````) that is run, with ``bash -e``, in the page's folder
    (typically the command that launches a ``file`` script);
  - ``timeout SECONDS``: a longer limit;
  - ``skip (REASON)``: a shell block that is not run, because it is a command a user types on
    their own machine: an install (``pip install`` changes the environment it runs in), a job
    that takes minutes, or a script of the device machine. The reason is required.

- A shell block must be tagged ``run`` or ``skip (...)``; a ``python`` block cannot be skipped.
  Blocks in other languages (``cuda``, ``c++``, ``text``, diagrams, Sphinx directives) are not
  programs on their own: they are run only as a ``file`` that a program uses.

A CPU block gets the page's earlier CPU ``file`` blocks; a GPU block gets every earlier one.

    python ci/doc_examples.py [--gpu] [--list] [PAGE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT = 120
SHELL = ("bash", "sh", "console", "shell")
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")
_TAG = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->\s*$")


class DocExampleError(ValueError):
    """A block whose tags break the rules above."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    gpu: bool = False
    file: str | None = None
    run: bool = False
    skip: str | None = None
    timeout: int = DEFAULT_TIMEOUT

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the block is a program that runs (a python block, or a shell block tagged run)."""
        return self.file is None and (self.lang == "python" or self.run)


def _tags(words: str, where: str) -> dict[str, object]:
    tags: dict[str, object] = {}
    rest = words
    while rest:
        if m := re.match(r"skip\s*\(([^)]+)\)\s*", rest):
            tags["skip"] = m.group(1).strip()
        elif m := re.match(r"file\s+([\w.-]+)\s*", rest):
            tags["file"] = m.group(1)
        elif m := re.match(r"timeout\s+(\d+)\s*", rest):
            tags["timeout"] = int(m.group(1))
        elif m := re.match(r"(gpu|run)\b\s*", rest):
            tags[m.group(1)] = True
        else:
            raise DocExampleError(
                f"{where}: unknown example tag in {words!r} (gpu, file NAME, run, timeout SECONDS, skip (REASON))"
            )
        rest = rest[m.end() :]
    return tags


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` with their tags; raises DocExampleError on a broken rule."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        indent = len(lines[i]) - len(lines[i].lstrip())
        text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        where = f"{page}:{i + 1}"
        tag = _TAG.match(lines[i - 1].strip()) if i else None
        tags = _tags(tag.group(1), where) if tag else {}
        block = Block(page, i + 1, lang, text, **tags)  # type: ignore[arg-type]
        if lang == "python" and block.skip:
            raise DocExampleError(f"{where}: a python block runs as written; it cannot be skipped")
        if lang in SHELL and not (block.run or block.skip or block.file):
            raise DocExampleError(
                f"{where}: a shell block is tagged run, or skip (REASON) when it is a "
                "command a user types on their own machine"
            )
        if block.run and lang not in SHELL:
            raise DocExampleError(f"{where}: only shell blocks are tagged run")
        out.append(block)
        i = end + 1
    return out


def pages() -> list[Path]:
    """Every page whose blocks are checked."""
    return sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("packages/*/README.md")) + [ROOT / "README.md"]


def run_block(block: Block, page_blocks: list[Block], workdir: Path, python: str = sys.executable) -> tuple[int, str]:
    """Runs ``block`` in ``workdir`` with the page's earlier ``file`` blocks saved there; returns
    (exit status, output). 124 when it ran past its timeout."""
    for earlier in page_blocks:
        if earlier.line >= block.line:
            break
        if earlier.file and earlier.gpu <= block.gpu:
            (workdir / earlier.file).write_text(earlier.text)
    script = workdir / f"example_{block.line}.{'py' if block.lang == 'python' else 'sh'}"
    script.write_text(block.text)
    cmd = [python, script.name] if block.lang == "python" else ["bash", "-e", script.name]
    env = dict(os.environ)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"  # python, torchrun, mpirun's peers
    # CI machines run as root in a container, and may have fewer cores than an example has ranks:
    # Open MPI refuses both unless told (a user's machine needs neither).
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # A session of its own: on timeout the example's whole process group goes (its peers too).
    with subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=block.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return 124, f"{out}\n(timed out after {block.timeout} s)"
        finally:
            with contextlib.suppress(ProcessLookupError):  # nothing the example started outlives it
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="run the blocks tagged gpu (on a CUDA machine)")
    ap.add_argument("--list", action="store_true", help="list the blocks and their tags, run nothing")
    ap.add_argument("pages", nargs="*", type=Path)
    args = ap.parse_args(argv)
    failed = 0
    for page in [p.resolve() for p in args.pages] or pages():
        page_blocks = blocks(page)
        for block in page_blocks:
            if args.list:
                print(
                    f"{block.name} {block.lang or '-'} gpu={block.gpu} file={block.file} runs={block.runs} "
                    f"skip={block.skip!r}"
                )
                continue
            if not block.runs or block.gpu != args.gpu:
                continue
            with tempfile.TemporaryDirectory(prefix="mori-doc-") as tmp:
                t0 = time.monotonic()
                rc, out = run_block(block, page_blocks, Path(tmp))
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {block.name} ({time.monotonic() - t0:.1f} s)", flush=True)
            if rc:
                failed += 1
                print("\n".join("    " + line for line in out.rstrip().splitlines()[-40:]), flush=True)
    if failed:
        print(f"{failed} doc example(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
