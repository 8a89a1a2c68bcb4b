"""A dataset exported by combee read back by a real consumer: pyarrow's JSON
Lines reader (what the Hugging Face `datasets` JSON loader runs on) reads
every record of each shape, with every reward, from the file `combee traces
export` writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.json as pj
import pytest
from conftest import Combee, binary, clean_env

N = 60


def export(combee: Combee, tmp_path: Path, *args: str) -> Path:
    out = tmp_path / f"{'-'.join(args) or 'combee'}.jsonl"
    env = {**clean_env(), "COMBEE_URL": combee.url, "COMBEE_API_KEY": combee.admin_key}
    done = subprocess.run(
        [str(binary()), "traces", "export", "eco-export", *args, "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_pyarrow_reads_every_record_and_reward(combee: Combee, tmp_path: Path) -> None:
    combee.create_prompt("eco-export", "You are a support agent for {topic}.")
    traces = [
        {
            "prompt": "eco-export", "prompt_version": 1,
            "input": [{"role": "user", "content": f"question {i}"}],
            "trajectory": [{"role": "tool", "content": f"lookup {i}", "tool_call_id": f"c{i}"}],
            "output": f"answer {i}",
            "feedback": {"score": i / N} if i % 3 else {"success": i % 2 == 0},
        }
        for i in range(N)
    ]
    res = combee.api("POST", "/v1/traces", json={"traces": traces[:40]})
    assert res.status_code == 201, res.text
    res = combee.api("POST", "/v1/traces", json={"traces": traces[40:]})
    assert res.status_code == 201, res.text
    rewards = sorted((t["feedback"].get("score", 1.0 if t["feedback"].get("success") else 0.0)) for t in traces)

    records = pj.read_json(export(combee, tmp_path)).to_pylist()
    assert len(records) == N
    # pyarrow's float parser may differ from Python's in the last bit.
    assert sorted(r["reward"] for r in records) == pytest.approx(rewards)
    assert sorted(r["output"] for r in records) == sorted(f"answer {i}" for i in range(N))

    chat = pj.read_json(export(combee, tmp_path, "--format", "chat")).to_pylist()
    assert len(chat) == N
    for record in chat:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "tool", "assistant"], record
        assert record["messages"][0]["content"] == "You are a support agent for {topic}."
        i = record["messages"][1]["content"].split()[-1]
        assert record["messages"][3]["content"] == f"answer {i}"

    table = pj.read_json(export(combee, tmp_path, "--format", "reward"))
    assert set(table.column_names) >= {"prompt", "completion", "reward", "success", "version", "trace_id"}
    assert sorted(table.column("reward").to_pylist()) == pytest.approx(rewards)
    assert set(table.column("version").to_pylist()) == {1}
    high = pj.read_json(export(combee, tmp_path, "--format", "reward", "--min-reward", "0.5")).num_rows
    assert high == sum(r >= 0.5 for r in rewards)
