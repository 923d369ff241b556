import json

from flatep.cli import main


def test_plan_prints_table(capsys):
    assert main(["plan", "--model", "qwen3-235b", "--ranks", "4", "--tokens", "64", "--maxvio", "3"]) == 0
    out = capsys.readouterr().out
    assert "rows before" in out and "maxvio" in out


def test_plan_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "load.png"
    code = main(["plan", "--model", "kimi-k2", "--tokens", "32", "--maxvio", "5", "--json", "--plot", str(plot)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    rows = [r["rows"] for r in summary["ranks"]]
    assert rows == [32 * 8] * 8
    assert abs(summary["maxvio"] - 5) <= 0.1
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_plan_bad_argument_is_one_line(capsys):
    assert main(["plan", "--ranks", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "divisible by ranks" in err
