"""bench/speculative.py: its arithmetic and table, and the round counter on the demo model."""

from __future__ import annotations

from bench.speculative import (
    Row,
    counting_rounds,
    markdown,
    per_draft_acceptance,
    render,
    summary,
)


def test_per_draft_acceptance_counts_refusals_not_unjudged_drafts() -> None:
    # 4 drafts, 1 kept then refused (the 2 after it never judged); 2 drafts, both kept
    assert per_draft_acceptance([(4, 1), (2, 2)]) == 3 / 4
    assert per_draft_acceptance([]) is None


def test_row_figures_and_table() -> None:
    row = Row("one process", 1, "extraction", "auto", 20.0, 30.0, drafted=40, accepted=30,
              predicted=1.4, predicted_profile="laptop", same=True, tokens=64)  # fmt: skip
    assert row.speedup == 1.5
    assert row.acceptance == 0.75
    assert row.tokens_per_step == 63 / 33
    other = Row("one process", 1, "story", "auto", 20.0, 18.0, drafted=0, accepted=0,
                same=True, tokens=64)  # fmt: skip
    assert other.acceptance is None
    lines = summary([row, other])
    assert lines[0] == "one process 1: mean speed-up 1.20 over 2 prompts, min 0.90"
    text = render([row, other])
    assert "extraction" in text and "1.50" in text and "1.40ᵃ" in text
    md = markdown([row, other], "python -m bench.speculative", ["a note"])
    assert md.startswith("| setup |") and "`python -m bench.speculative`" in md
    assert "a note" in md
    assert row.as_dict()["speedup"] == 1.5


def test_counting_rounds_sees_the_engine_rounds_and_restores() -> None:
    from cellswarm.demo import demo_model_path
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.engine.speculative import AdaptiveK
    from cellswarm.loader import load

    model = load(str(demo_model_path()))
    ids = model.tokenizer.encode("one two three four five six, one two three four five six, "
                                 "one two three four five six, one two three")  # fmt: skip
    original = AdaptiveK.observe
    with counting_rounds() as rounds:
        g = model.generate(ids, GenerateOptions(max_tokens=12, stop_ids=frozenset(),
                                                speculative="lookup"))  # fmt: skip
    assert AdaptiveK.observe is original
    assert g.stats.drafted_tokens > 0
    # every verified round but the last (whose tokens end the generation) was counted
    assert sum(d for d, _ in rounds) == g.stats.drafted_tokens
    assert sum(k for _, k in rounds) == g.stats.accepted_tokens
