"""The ctypes structures and constants of mori.io.backends.rdma._ucx against UCX's own headers.

A C file built from the headers the libucx wheel ships prints every size, offset and constant the
backend uses; each must equal what ctypes computes. A UCX release that moves a field fails here.
"""

from __future__ import annotations

import ctypes as C
import shutil
import subprocess
from pathlib import Path

import libucx  # type: ignore[import-not-found]

from mori.io.backends.rdma import _ucx as U

# (C type, ctypes class, {ctypes field: C member expression} where they differ)
STRUCTS = [
    ("ucp_params_t", U.UcpParams, {}),
    ("ucp_worker_params_t", U.UcpWorkerParams, {}),
    ("ucp_ep_params_t", U.UcpEpParams, {"err_handler_cb": "err_handler.cb", "err_handler_arg": "err_handler.arg"}),
    ("ucp_mem_map_params_t", U.UcpMemMapParams, {}),
    ("ucp_request_param_t", U.UcpRequestParam, {}),
    ("ucp_am_handler_param_t", U.UcpAmHandlerParam, {}),
    ("ucs_sock_addr_t", U.UcsSockAddr, {}),
    ("uct_component_attr_t", U.UctComponentAttr, {}),
    ("uct_md_resource_desc_t", U.UctMdResourceDesc, {}),
]
CONSTANTS = [name for name in dir(U) if name.startswith(("UCS_", "UCP_", "UCT_")) and isinstance(getattr(U, name), int)]


def _header_values(tmp_path: Path) -> dict[str, int]:
    include = Path(libucx.__file__).parent / "include"
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <ucp/api/ucp.h>", "#include <uct/api/uct.h>",
             "int main(void) {"]
    for ctype, cls, rename in STRUCTS:
        lines.append(f'printf("sizeof {ctype} %zu\\n", sizeof({ctype}));')
        for name, *_ in cls._fields_:
            member = rename.get(name, name)
            lines.append(f'printf("offsetof {ctype} {name} %zu\\n", offsetof({ctype}, {member}));')
            lines.append(f'printf("sizeof {ctype} {name} %zu\\n", sizeof((({ctype}*)0)->{member}));')
    lines.append('printf("sizeof ucs_status_t %zu\\n", sizeof(ucs_status_t));')
    for name in CONSTANTS:
        lines.append(f'printf("const {name} %lld\\n", (long long)({name}));')
    lines.append("return 0; }")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines))
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed (ci/setup.sh installs g++, which brings gcc)"
    subprocess.run([cc, "-o", str(exe), str(src), f"-I{include}"], check=True, capture_output=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


def test_structures_and_constants_match_the_headers(tmp_path: Path) -> None:
    got = _header_values(tmp_path)
    mismatches = []
    for ctype, cls, _ in STRUCTS:
        if got[f"sizeof {ctype}"] != C.sizeof(cls):
            mismatches.append(f"sizeof {ctype}: C {got[f'sizeof {ctype}']}, ctypes {C.sizeof(cls)}")
        for name, ftype, *_ in cls._fields_:
            offset = getattr(cls, name).offset
            if got[f"offsetof {ctype} {name}"] != offset or got[f"sizeof {ctype} {name}"] != C.sizeof(ftype):
                mismatches.append(f"{ctype}.{name}: C offset {got[f'offsetof {ctype} {name}']} size "
                                  f"{got[f'sizeof {ctype} {name}']}, ctypes {offset}/{C.sizeof(ftype)}")
    if got["sizeof ucs_status_t"] != C.sizeof(U._STATUS):
        mismatches.append("ucs_status_t size")
    for name in CONSTANTS:
        if got[f"const {name}"] != getattr(U, name):
            mismatches.append(f"{name}: C {got[f'const {name}']}, _ucx {getattr(U, name)}")
    assert not mismatches, "\n".join(mismatches)
    assert len(CONSTANTS) > 30
