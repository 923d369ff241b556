"""The decode benchmark runs end to end on a toy shape (CPU: the interpreter) and names a crossover."""
import json

from flatep.bench import decode
from flatep.config import MODEL_SHAPES


def test_decode_bench_writes_every_arm(tmp_path, monkeypatch):
    monkeypatch.setitem(MODEL_SHAPES, "toy", (64, 16, 2, 32))
    monkeypatch.setattr(decode, "CANDIDATES", decode.CANDIDATES[:1])
    monkeypatch.setattr(decode, "HOT_CANDIDATES", decode.HOT_CANDIDATES[:1])
    out = tmp_path / "decode.json"
    assert decode.main(["--models", "toy", "--rows", "4", "--iters", "1", "--maxvio", "1", "--step-tokens", "4",
                        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(cell["active_experts"], cell["rows_per_expert"]) for cell in result["cells"]] == [(2, 1), (2, 4)]
    (routed,) = result["routed_cells"]
    # The busiest of 8 ranks holding 16 / 8 = 2 experts each, of 8 * 4 tokens' 2 entries each.
    assert len(routed["group_rows"]) == 2 and routed["rows"] == sum(routed["group_rows"]) >= 8 * 4 * 2 // 8
    assert routed["maxvio_target"] == 1.0 and routed["maxvio"] > 0
    for cell in result["cells"] + [routed]:
        assert set(cell["arms"]) == {"torch", "decode", "decode m16 n128 k128 w4 s3 g8 p2 swap",
                                     "decode split hot m64 n64 k128 w4 s4 g8 p2"}
        assert all(arm["rel_error"] < 1e-2 for arm in cell["arms"].values())
        assert cell["weight_bytes"] == cell["active_experts"] * 3 * 64 * 32 * 2


def test_crossover_is_the_last_size_decode_wins_from_the_first():
    def cell(rows, torch_us, decode_us):
        return {"rows_per_expert": rows, "arms": {"torch": {"us": torch_us}, "decode": {"us": decode_us}}}

    assert decode._crossover([cell(1, 10, 5), cell(8, 10, 9), cell(64, 10, 11), cell(128, 10, 9)]) == 8
    assert decode._crossover([cell(1, 10, 12)]) == 0
