"""cellswarm's copy of the GGUF numbering (quant/ggml_types.py) is gguf-py's, member for member."""

from __future__ import annotations

import subprocess
import sys

import gguf

from cellswarm.quant import ggml_types


def test_the_numbering_is_gguf_pys() -> None:
    for ours, theirs in [(ggml_types.GGMLQuantizationType, gguf.GGMLQuantizationType),
                         (ggml_types.GGUFValueType, gguf.GGUFValueType)]:  # fmt: skip
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
    assert list(ggml_types.READER_SUPPORTED_VERSIONS) == list(gguf.READER_SUPPORTED_VERSIONS)
    assert ggml_types.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    assert {k.name: v for k, v in ggml_types.GGML_QUANT_SIZES.items()} == \
        {k.name: v for k, v in gguf.GGML_QUANT_SIZES.items()}  # fmt: skip


def test_a_worker_reads_models_without_importing_gguf_py() -> None:
    """Its 4.6 MB are a sixtieth of a 256 MiB node (docs/scale.md, a worker's footprint)."""
    code = ("import sys, cellswarm.swarm.node.worker, cellswarm.engine.model, "
            "cellswarm.io.gguf_file, cellswarm.loader; print(sorted(m for m in sys.modules "
            "if m == 'gguf' or m.startswith(('gguf.', 'yaml'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
