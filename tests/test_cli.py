"""`flatep plan` and the parser: output, help texts, one-line errors."""
import json
import sys

import pytest
import torch

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


def test_plan_auto_takes_a_cost_profile_by_name_or_file(tmp_path, capsys):
    from flatep import CostProfile

    path = tmp_path / "profile.json"
    CostProfile.preset("h200").save(path)
    for cost in ("h200", str(path)):
        assert main(["plan", "--model", "kimi-k2", "--tokens", "1", "--policy", "auto", "--cost", cost, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["borrowed_experts"] == 0  # decode: moving weights never pays
    assert main(["plan", "--cost", "h200"]) == 2
    assert "--cost is for --policy auto" in capsys.readouterr().err
    assert main(["plan", "--policy", "auto", "--cost", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _option_help(text: str) -> dict[str, str]:
    """``--option`` -> its help paragraph, from an argparse help text."""
    entries, current = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") and not line.startswith("  -h"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif line.startswith("  ") and not line.startswith("   ") and stripped and current is None:
            continue
        elif current is not None and line.startswith("      "):
            entries[current] += " " + stripped
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_every_option_has_help_and_shows_its_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    options = _option_help(text)
    assert len(options) >= 6, text
    for option, paragraph in options.items():
        assert "(default:" in paragraph, f"{option}: {paragraph}"
    assert "`" not in text  # plain text, no reST markup


def test_top_level_description_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "`" not in text and "flatep plan" in text and "flatep bench" in text


def test_plot_without_suffix_writes_the_name_it_prints(tmp_path, capsys):
    stem = tmp_path / "load"
    assert main(["plan", "--ranks", "4", "--model", "qwen3-235b", "--tokens", "16", "--plot", str(stem)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    written = printed.removeprefix("plot written to ")
    assert written == str(stem) + ".png"
    assert open(written, "rb").read()[:4] == b"\x89PNG"


def test_unreachable_maxvio_is_reported(capsys):
    # Kimi-K2: E/K - 1 = 47 is the largest maxvio any routing has.
    assert main(["plan", "--tokens", "32", "--maxvio", "100"]) == 0
    err = capsys.readouterr().err
    assert "maxvio target 100 not reached" in err and "47" in err


def test_reachable_maxvio_is_not_reported(capsys):
    assert main(["plan", "--tokens", "64", "--maxvio", "3"]) == 0
    assert "not reached" not in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["plan", "--tokens", "16", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_device_cuda_without_gpu_is_one_line(capsys):
    assert main(["bench", "tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err


@pytest.mark.parametrize("option, value, named", [("--cost", "h100", "cost:"), ("--weights", "fp8", "weights: fp8 does not fit")])
def test_bench_bad_weights_or_cost_option_is_one_line(option, value, named, capsys):
    assert main(["bench", "tiny", "--device", "cpu", option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err
