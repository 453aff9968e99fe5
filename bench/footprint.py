"""A worker's own memory before any weight, import by import.

    python -m bench.footprint

Each line is this process's resident set (VmRSS) and its anonymous and file-backed parts
after importing the next piece of what a worker imports (docs/scale.md, "A worker's own
footprint"). Run it in a fresh interpreter: nothing but this module imported before.
"""

from __future__ import annotations

import re
from pathlib import Path


def resident() -> str:
    status = Path("/proc/self/status").read_text()

    def mib(key: str) -> float:
        found = re.search(key + r":\s+(\d+)", status)
        return int(found.group(1)) / 1024 if found else float("nan")

    return f"{mib('VmRSS'):6.1f} MiB  (anon {mib('RssAnon'):5.1f}, file {mib('RssFile'):5.1f})"


def main() -> None:
    print(f"{'the interpreter':48} {resident()}")
    import numpy as np

    a = np.ones((64, 64), np.float32)
    a @ a
    print(f"{'numpy and a first BLAS matmul':48} {resident()}")
    import cellswarm.engine.model
    import cellswarm.io.gguf_file
    import cellswarm.models.deepseek2
    import cellswarm.models.llama

    print(f"{'the engine, the GGUF reader, the architectures':48} {resident()}")
    from cellswarm import kernels

    kernels.enabled()
    print(f"{'the kernels shared object and OpenMP':48} {resident()}")
    import cellswarm.swarm.node.worker  # noqa: F401

    print(f"{'the worker module (asyncio, TLS, HTTP, protocol)':48} {resident()}")


if __name__ == "__main__":
    main()
