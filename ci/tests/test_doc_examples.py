"""Every code block of the docs and READMEs runs as written (ci/doc_examples.py has the rules):
each CPU example runs here in a fresh process; GPU examples at least compile here and run in
ci/device/doc_examples.sh."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_examples as docs  # noqa: E402  (ci/doc_examples.py)

PAGES = {page: docs.blocks(page) for page in docs.pages()}
CPU = [(block, blocks) for blocks in PAGES.values() for block in blocks if block.runs and not block.gpu]


def test_pages_hold_examples_of_every_kind() -> None:
    every = [b for blocks in PAGES.values() for b in blocks]
    assert sum(b.lang == "python" for b in every) >= 20
    assert any(b.gpu and b.runs for b in every) and any(b.file for b in every) and any(b.skip for b in every)
    assert len(CPU) >= 15


@pytest.mark.parametrize(
    "block", [b for blocks in PAGES.values() for b in blocks if b.lang == "python"], ids=lambda b: b.name
)
def test_every_python_block_compiles(block: docs.Block) -> None:
    compile(block.text, block.name, "exec")  # the GPU ones too, which run only on the device


@pytest.mark.parametrize("block, page_blocks", CPU, ids=[b.name for b, _ in CPU])
def test_cpu_example_runs(block: docs.Block, page_blocks: list[docs.Block], tmp_path: Path) -> None:
    rc, out = docs.run_block(block, page_blocks, tmp_path)
    assert rc == 0, f"{block.name} exited with {rc}:\n{out}"


# ---- the runner's rules, on planted pages -------------------------------------------------------
def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("```bash\npip install x\n```\n", "a shell block is tagged run, or skip"),
        ("<!-- example: skip (no reason to run) -->\n```python\nprint(1)\n```\n", "cannot be skipped"),
        ("<!-- example: gpu fast -->\n```python\nprint(1)\n```\n", "unknown example tag"),
        ("<!-- example: skip -->\n```bash\nls\n```\n", "unknown example tag"),  # a reason is required
        ("<!-- example: run -->\n```python\nprint(1)\n```\n", "only shell blocks are tagged run"),
    ],
)
def test_broken_rules_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(docs.DocExampleError, match=message):
        docs.blocks(page(tmp_path, text))


def test_a_file_and_the_command_that_runs_it(tmp_path: Path) -> None:
    blocks = docs.blocks(
        page(
            tmp_path,
            (
                "Save as `hello.py`:\n\n<!-- example: file hello.py -->\n```python\nprint('hello', 6 * 7)\n```\n\n"
                "<!-- example: gpu file gpu.py -->\n```python\nraise SystemExit('not on the CPU')\n```\n\n"
                "<!-- example: run timeout 30 -->\n```bash\npython hello.py\ntest ! -e gpu.py\n```\n"
            ),
        )
    )
    assert [(b.file, b.gpu, b.runs, b.timeout) for b in blocks] == [
        ("hello.py", False, False, 120),
        ("gpu.py", True, False, 120),
        (None, False, True, 30),
    ]
    work = tmp_path / "work"
    work.mkdir()
    rc, out = docs.run_block(blocks[2], blocks, work)
    assert (rc, out) == (0, "hello 42\n")


def test_a_failing_or_hanging_example_fails(tmp_path: Path) -> None:
    blocks = docs.blocks(
        page(
            tmp_path,
            (
                "```python\nassert 1 + 1 == 3, 'arithmetic'\n```\n\n"
                "<!-- example: timeout 1 -->\n```python\nimport time\ntime.sleep(30)\n```\n"
            ),
        )
    )
    rc, out = docs.run_block(blocks[0], blocks, tmp_path)
    assert rc == 1 and "AssertionError: arithmetic" in out
    rc, out = docs.run_block(blocks[1], blocks, tmp_path)
    assert rc == 124 and "timed out after 1 s" in out
