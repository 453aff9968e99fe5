"""Quality of re-quantizing the demo model, on real text.

    python -m bench.quant_quality

The demo GGUF (Q4_1 layers, Q8_0 embedding) is unpacked to float32 — the reference — and
re-packed as Q8_0 and Q4_0; each copy runs over tests/data/sample_text.txt in windows and is
compared with the reference: perplexity, mean KL divergence, top-1 agreement.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cellswarm.demo import demo_model_path
from cellswarm.engine.model import Model
from cellswarm.engine.quality import compare, perplexity
from cellswarm.loader import load

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "sample_text.txt"
WINDOW = 256


def windowed_logits(model: Model, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([model.logits(ids[i : i + WINDOW]) for i in range(0, len(ids), WINDOW)])


def main() -> None:
    path = demo_model_path()
    reference = load(path, quant="f32")
    ids = np.asarray(reference.tokenizer.encode(TEXT.read_text()))
    ref = windowed_logits(reference, ids)
    print(f"{len(ids)} tokens of {TEXT.name}, windows of {WINDOW}")
    print(f"{'weights':<22} {'MiB':>7} {'perplexity':>11} {'mean KL':>9} {'top-1':>8}")
    print(f"{'f32 (unpacked)':<22} {reference.memory().weight_bytes / 2**20:>7.1f} "
          f"{perplexity(ref, ids):>11.3f} {0:>9.5f} {100:>7.2f}%")  # fmt: skip
    for name, quant in (("as shipped (Q4_1)", None), ("q8_0", "q8_0"), ("q4_0", "q4_0")):
        model = load(path, quant=quant)
        q = compare(ref, windowed_logits(model, ids), ids)
        print(
            f"{name:<22} {model.memory().weight_bytes / 2**20:>7.1f} {q.perplexity:>11.3f} "
            f"{q.mean_kl:>9.5f} {100 * q.top1_agreement:>7.2f}%"
        )


if __name__ == "__main__":
    main()
