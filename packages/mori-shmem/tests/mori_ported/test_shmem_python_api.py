"""Runs the port of MORI's ``examples/shmem/shmem_python_api.py`` as its users run it.

The example is a script: ``WORLD_SIZE`` is the number of nodes, ``GPU_PER_NODE`` the PEs per node
(spawned by ``torch.multiprocessing``), ``RANK`` the node's rank and ``MASTER_ADDR``/``MASTER_PORT``
the torch store. One node with 2 and with 4 PEs; every PE must report itself.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from utils import get_free_port


@pytest.mark.parametrize("pes", [2, 4])
def test_example_runs_as_written(pes):
    script = Path(__file__).with_name("shmem_python_api.py")
    # The example binds MASTER_PORT itself, some time after the port was found free: another
    # process (CI's other lanes) may take it between, so a run that lost it goes again on another.
    for _ in range(3):
        env = dict(os.environ, WORLD_SIZE="1", GPU_PER_NODE=str(pes), RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(get_free_port()))
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-4000:]
    found = sorted(re.findall(r"I'm pe (\d+) in (\d+) pes", done.stdout))
    assert found == [(str(pe), str(pes)) for pe in range(pes)], done.stdout
    assert done.stdout.count("process group ok") == pes
