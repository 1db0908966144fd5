import json

from hearth.cli import main


def test_bench_offline_reports_throughput_and_writes_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "offline.json"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_llama),
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--dtype",
            "float32",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 4
    assert result["output_throughput_tok_s"] > 0
    assert result["total_throughput_tok_s"] > result["output_throughput_tok_s"]
    assert result["peak_rss_gib"] > 0
    assert "tok/s" in capsys.readouterr().out


def test_bench_offline_unsupported_model_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    assert main(["bench", "offline", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "BertModel" in err and "LlamaForCausalLM" in err
