"""`hearth bench advise`: the arithmetic from a small trace, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

from hearth.cli import main


def test_advice_from_an_agentic_trace(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    # Two sessions over 10 s; each turn re-sends the history (the previous prompt is a cached prefix).
    rows = [
        {"timestamp": 0, "session_id": "a", "input_tokens": 1000, "output_tokens": 50},
        {"timestamp": 2, "session_id": "b", "input_tokens": 1000, "output_tokens": 50},
        {"timestamp": 5, "session_id": "a", "input_tokens": 1500, "output_tokens": 100},
        {"timestamp": 10, "session_id": "b", "input_tokens": 1500, "output_tokens": 100},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    code = main(
        ["bench", "advise", "--trace", str(trace), "--prefill-rate", "200", "--decode-rate", "20", "--json"]
    )
    assert code == 0
    out = capsys.readouterr().out
    numbers = json.loads(out.strip().splitlines()[-1])
    # 5000 prompt tokens, 2000 cached -> 3000 uncached over 10 s = 300 tokens/s; 300 output tokens/10 s = 30/s.
    assert numbers["hit_ratio"] == 0.4
    assert numbers["prefill_load_tokens_per_s"] == 300 and numbers["decode_load_tokens_per_s"] == 30
    assert numbers["prefill_servers"] == 3  # ceil(300 / (200 x 0.7))
    assert numbers["decode_servers"] == 3  # ceil(30 / (20 x 0.7))
    # 0.4 req/s x 75 tokens x 0.05 s = 1.5 concurrent decodes; / 3 servers x 1.5 headroom -> 1
    assert numbers["decode_max_num_seqs"] == 1
    assert "hearth launch --prefill 3 --decode 3" in out
