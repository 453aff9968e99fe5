"""lm-evaluation-harness as a user runs it: `lm_eval --model local-completions` against a
running swarm (its OpenAI completions route, its vLLM tokenizer routes), and `lm_eval --model
hf` on the same GGUF (transformers dequantizes it), over a small multiple-choice task shipped
in tests/data/lm_eval (a local YAML task over a jsonl file: nothing is downloaded).

The two engines differ in arithmetic (the swarm's int8 activations, transformers' float32 of
the dequantized weights), so items the model finds a near tie may go either way: every item
whose best two choices are further apart than NEAR_TIE (in the reference's log-likelihoods)
must be chosen alike, and the accuracies may differ by one item at most."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellswarm.swarm.local.up import LocalSwarm

DATA = Path(__file__).parent / "data" / "lm_eval" / "multiple_choice.jsonl"
KEY = "sk-lm-eval-test"
NEAR_TIE = 0.25  # nats between the best two choices


def _task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cellswarm_mc.yaml").write_text(f"""task: cellswarm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return folder


def _lm_eval(args: list[str], out: Path, env: dict[str, str]) -> dict[int, list[float]]:
    """Each doc's log-likelihoods of its choices, from lm_eval's logged samples."""
    cmd = [sys.executable, "-m", "lm_eval", *args, "--tasks", "cellswarm_mc",
           "--include_path", str(out.parent / "task"), "--output_path", str(out),
           "--log_samples", "--batch_size", "1"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = next(out.rglob("samples_cellswarm_mc_*.jsonl"))
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {int(r["doc_id"]): [float(x[0]) for x in r["filtered_resps"]] for r in rows}


@pytest.fixture(scope="module")
def swarm(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    state = tmp_path_factory.mktemp("lmeval")
    keys = state / "api-keys"
    keys.write_text(KEY + "\n")
    with LocalSwarm(str(demo_path), 2, "160M", state, api_key_file=str(keys)) as s:
        s.wait_ready()
        yield s


def test_lm_eval_on_the_swarm_chooses_as_transformers_does(
    swarm: LocalSwarm, demo_path: Path, tmp_path: Path
) -> None:
    pytest.importorskip("lm_eval")
    _task(tmp_path / "task")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": KEY,
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    ours = _lm_eval(["--model", "local-completions", "--model_args",
                     f"model={demo_path.name},base_url={swarm.url}/v1/completions,"
                     f"tokenizer_backend=remote,auth_token={KEY},num_concurrent=1,"
                     "max_retries=1,tokenized_requests=True"],
                    tmp_path / "swarm", env)  # fmt: skip
    ref = _lm_eval(["--model", "hf", "--model_args",
                    f"pretrained={demo_path.parent},gguf_file={demo_path.name},"
                    "dtype=float32", "--device", "cpu"],
                   tmp_path / "hf", env)  # fmt: skip
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert sorted(ours) == sorted(ref) == list(range(len(docs)))

    def best(lls: list[float]) -> int:
        return max(range(len(lls)), key=lls.__getitem__)

    clear = 0
    for i, doc in enumerate(docs):
        top2 = sorted(ref[i], reverse=True)[:2]
        if top2[0] - top2[1] > NEAR_TIE:
            clear += 1
            assert best(ours[i]) == best(ref[i]), (doc, ours[i], ref[i])
    assert clear >= len(docs) // 2  # the comparison says something
    acc = [sum(best(r[i]) == d["answer"] for i, d in enumerate(docs)) for r in (ours, ref)]
    assert abs(acc[0] - acc[1]) <= 1, acc
    print(f"lm-eval accuracy: swarm {acc[0]}/{len(docs)}, transformers {acc[1]}/{len(docs)}; "
          f"{clear} clear items chosen alike")
