"""The experts-phase timer: its cells, its variants, and the swap of the packed GEMMs for another revision's."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flatep.bench.experts_phase as experts_phase
import flatep.experts.grouped as grouped
import flatep.kernels.mxfp4_swap
from flatep import EPConfig, init_group
from flatep.bench.experts_phase import (
    IN_TURN, PACKED_GEMMS, dispatch_into_nan, gemms_in_use, main, revision_gemms, source_digest,
)
from flatep.kernels.backend import use_triton
from flatep.kernels.dispatch import real_rows_torch
from flatep.layer import dispatch_step, experts_step, packed_rows, plan_step
from tests.helpers import make_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REPOSITORY = Path(__file__).resolve().parents[2]
has_history = shutil.which("git") is not None and subprocess.run(
    ["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"], capture_output=True).returncode == 0
needs_history = pytest.mark.skipif(not has_history, reason="needs the git history of the checkout")

TINY_MXFP4 = """
name: tiny-mxfp4
model: {hidden: 64, experts: 8, top_k: 2, intermediate: 64}
ranks: 2
tokens: [8]
maxvio: [0, 2]
arms: [classic]
weights: mxfp4
warmup: 0
iters: 1
"""


def test_gemms_in_use_swaps_the_packed_gemms_and_restores_them():
    originals = {name: getattr(grouped, name) for name in PACKED_GEMMS}
    replacements = {name: (lambda *args, **kwargs: None) for name in PACKED_GEMMS}
    with gemms_in_use(replacements):
        assert all(getattr(grouped, name) is replacements[name] for name in PACKED_GEMMS)
    assert all(getattr(grouped, name) is originals[name] for name in PACKED_GEMMS)
    with pytest.raises(RuntimeError), gemms_in_use(replacements):
        raise RuntimeError("restored on errors too")
    assert all(getattr(grouped, name) is originals[name] for name in PACKED_GEMMS)


@needs_history
def test_revision_gemms_loads_that_revisions_kernels_and_rejects_unknown_ones(monkeypatch):
    monkeypatch.chdir(REPOSITORY)
    gemms = revision_gemms("HEAD")
    assert set(gemms) == set(PACKED_GEMMS)
    assert all(gemms[name] is not getattr(grouped, name) for name in PACKED_GEMMS)
    with pytest.raises(ValueError, match="--against 'no-such-revision'"):
        revision_gemms("no-such-revision")


@needs_history
def test_revision_gemms_runs_that_revisions_kernel_modules_not_this_trees(monkeypatch):
    """Every kernel module of the revision comes along, so a change to a launch constant (not to
    quant_gemm.py) shows in the comparison."""
    monkeypatch.chdir(REPOSITORY)
    gemms = revision_gemms("HEAD")
    package = gemms["mxfp4_grouped_mm_triton"].__module__.rpartition(".")[0]
    assert package.startswith("flatep_kernels_at_")
    quant_gemm = sys.modules[f"{package}.quant_gemm"]
    assert quant_gemm.mxfp4_swap is sys.modules[f"{package}.mxfp4_swap"] is not flatep.kernels.mxfp4_swap
    assert revision_gemms("HEAD")["mxfp4_grouped_mm_triton"] is not gemms["mxfp4_grouped_mm_triton"]  # loaded anew


def test_revision_gemms_takes_a_copy_of_the_kernels_directory(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(REPOSITORY / "flatep/kernels", copy, ignore=shutil.ignore_patterns("__pycache__"))
    swap = copy / "mxfp4_swap.py"
    swap.write_text(swap.read_text().replace("\nLOAD_STAGES = ", "\nLOAD_STAGES = 1 + "))
    gemms = revision_gemms(str(copy))
    package = gemms["mxfp4_grouped_mm_triton"].__module__.rpartition(".")[0]
    assert sys.modules[f"{package}.packed_tiles"].MXFP4_SWAP[32].num_stages == flatep.kernels.mxfp4_swap.LOAD_STAGES + 1
    assert gemms["packed_launches"].__module__ == f"{package}.packed_tiles"
    assert all(gemms[name] is not getattr(grouped, name) for name in PACKED_GEMMS)
    (copy / "quant_gemm.py").unlink()
    with pytest.raises(ValueError, match="hold no quant_gemm.py"):
        revision_gemms(str(copy))


def test_revision_gemms_removes_its_temporary_package_when_the_process_exits():
    script = ("import sys; from pathlib import Path; from flatep.bench.experts_phase import revision_gemms; "
              "gemms = revision_gemms(sys.argv[1]); "
              "print(Path(sys.modules[gemms['mxfp4_grouped_mm_triton'].__module__].__file__).parents[1])")
    shown = subprocess.run([sys.executable, "-c", script, str(REPOSITORY / "flatep/kernels")], cwd=REPOSITORY,
                           capture_output=True, text=True, check=True)
    temporary = Path(shown.stdout.strip().splitlines()[-1])
    assert temporary.name.startswith("tmp") and not temporary.exists()


def test_revision_gemms_takes_a_copy_of_the_module(tmp_path):
    copy = tmp_path / "quant_gemm_copy.py"
    copy.write_text((REPOSITORY / "flatep/kernels/quant_gemm.py").read_text())
    gemms = revision_gemms(str(copy))
    assert set(gemms) == set(PACKED_GEMMS)
    for name in ("fp8_grouped_mm_triton", "mxfp4_grouped_mm_triton"):
        assert gemms[name] is not getattr(grouped, name)
    # the copy alone: the other kernel modules, and so the launches' tiles, are this tree's
    assert sys.modules[gemms["mxfp4_grouped_mm_triton"].__module__].mxfp4_swap is flatep.kernels.mxfp4_swap
    assert gemms["packed_launches"] is grouped.packed_launches


@needs_history
def test_cells_time_every_variant_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(REPOSITORY)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_MXFP4)
    out = tmp_path / "experts.json"
    # The Triton kernels (interpreter on CPU) where they run: the --against variant then calls HEAD's.
    backend = "triton" if use_triton(DEVICE) else "torch"
    rows = main([str(config), "--against", "HEAD", "--backend", backend, "--profile", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(row["tokens"], row["maxvio_target"]) for row in rows] == [(8, 0.0), (8, 2.0)]
    for row in rows:
        assert set(row["experts_us"]) == {"packed", "against", "bf16"}
        assert all(len(times) == 2 and min(times) > 0 for times in row["experts_us"].values())
        assert row["experts_us_max"]["packed"] == max(row["experts_us"]["packed"])
        assert row["ratio"]["bf16"] == 1.0 and row["against"] == "HEAD" and row["weights"] == "mxfp4"
        assert row["layout"] == "words"
        # Bytes: whole experts of the variant's slowest rank (each variant's own), a packed mxfp4
        # expert 17/64 of a bf16 one (values and scales against 2 bytes a weight; the tiny model's
        # experts have no biases), and a read rate against the ceiling on a GPU.
        expert_bf16 = 2 * 3 * 64 * 64  # w13 [2I, H] and w2 [H, I], bf16
        expert_bytes = {"packed": expert_bf16 * 17 // 64, "against": expert_bf16 * 17 // 64, "bf16": expert_bf16}
        for variant, read in row["weight_bytes_read"].items():
            assert read % expert_bytes[variant] == 0 and 0 < read // expert_bytes[variant] <= 8, (variant, read)
        assert (row["read_ceiling_gbps"] is None) == (DEVICE.type != "cuda")
        assert all((fraction is None) == (DEVICE.type != "cuda") for fraction in row["read_fraction"].values())
        # Per kernel on a GPU (the experts' GEMMs among them); the profiler is not run on the CPU.
        assert set(row["kernels_us"]) == {"packed", "against", "bf16"}
        assert all(bool(kernels) == (DEVICE.type == "cuda") for kernels in row["kernels_us"].values())


def test_in_turn_times_the_launches_one_after_another_beside_side_by_side(tmp_path, monkeypatch):
    """``--in-turn`` adds a variant timed beside ``packed``: the same GEMMs, with grouped's
    ``side_by_side`` swapped for ``in_turn`` while it runs (and restored after)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_MXFP4)
    runners = []
    original = grouped.side_by_side

    def spy(shard, shard_weights, *args, **options):
        runners.append(grouped.side_by_side)
        experts_step(shard, shard_weights, *args, **options)

    monkeypatch.setattr(experts_phase, "experts_step", spy)
    backend = "triton" if use_triton(DEVICE) else "torch"
    rows = main([str(config), "--tokens", "8", "--maxvio", "2", "--in-turn", "--backend", backend])
    assert set(rows[0]["experts_us"]) == {"packed", "in_turn", "bf16"}
    assert original in runners and IN_TURN["side_by_side"] in runners
    assert grouped.side_by_side is original


def test_every_timed_call_computes_on_the_dispatched_rows(tmp_path, monkeypatch):
    """The experts write into a buffer of their own, never into the shard they read: in place, each
    replay would compute on the last one's outputs (values shrinking replay by replay)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_MXFP4)
    calls = []

    def spy(shard, shard_weights, *args, out=None, **options):  # no host sync: CUDA graphs capture it
        calls.append(out is not None and out.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr())
        experts_step(shard, shard_weights, *args, out=out, **options)

    monkeypatch.setattr(experts_phase, "experts_step", spy)
    # On a GPU the triton backend: the torch one's dispatch syncs with the host, which graph capture refuses.
    main([str(config), "--tokens", "8", "--maxvio", "0", "--backend", "triton" if use_triton(DEVICE) else "torch"])
    assert calls and all(calls)


@pytest.mark.parametrize("policy", ["exact", "none"])
def test_dispatch_into_nan_leaves_only_the_unwritten_rows_nan(policy):
    """The real rows hold what a plain dispatch writes; every other row of the step's buffers
    (group padding, the split layout's gap between home and slot rows, rows past the last group)
    holds NaN, in the same buffers the experts read."""
    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=32, intermediate=16, capacity=9, align=4)
    x, ids, weights, _, _ = make_inputs(config, 9, 2.0, torch.bfloat16, seed=5)
    clean_group, group = (init_group("local", ranks=config.ranks, device=DEVICE) for _ in range(2))
    plan = plan_step(ids, config, group, policy)
    clean, clean_weights = dispatch_step(x, weights, plan, clean_group, "torch")
    shard, shard_weights = dispatch_into_nan(x, weights, plan, group, "torch")
    real = real_rows_torch(plan.offsets, plan.padding, plan.slot_base, shard.shape[-2])
    assert 0 < int(real.sum()) < real.numel()
    assert torch.equal(shard[real], clean[real]) and torch.equal(shard_weights[real], clean_weights[real])
    assert bool(shard[~real].isnan().all()) and bool(shard_weights[~real].isnan().all())
    again, _ = dispatch_step(x, weights, plan, group, "torch")
    assert again.data_ptr() == shard.data_ptr()


def test_fp8_dispatch_into_nan_keeps_the_real_packed_rows():
    """With fp8 rows left packed (as fp8 experts read them), the real rows' values and scales are a
    plain fp8 dispatch's, and the other rows of the packed buffer hold NaN bytes."""
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=256, intermediate=128, capacity=9, align=4)
    x, ids, weights, _, _ = make_inputs(config, 9, 2.0, torch.bfloat16, seed=6)
    clean_group, group = (init_group("local", ranks=config.ranks, device=DEVICE) for _ in range(2))
    plan = plan_step(ids, config, group, "exact", dispatch_dtype=torch.float8_e4m3fn)
    clean, _ = dispatch_step(x, weights, plan, clean_group, "torch", dispatch_dtype=torch.float8_e4m3fn, unpack=False)
    shard, _ = dispatch_into_nan(x, weights, plan, group, "torch", torch.float8_e4m3fn, unpack=False)
    real = real_rows_torch(plan.offsets, plan.padding, plan.slot_base, shard.shape[-2])
    expected, got = packed_rows(clean_group, clean), packed_rows(group, shard)
    assert torch.equal(got.values[real].view(torch.uint8), expected.values[real].view(torch.uint8))
    assert torch.equal(got.scales[real], expected.scales[real])
    assert bool(got.scales[~real].isnan().all()) and bool(got.values[~real].float().isnan().all())


def test_fp8_dispatch_cells_time_each_variants_dispatch(tmp_path):
    """``--dispatch fp8``: the packed fp8 pool's rows come packed (its experts quantize nothing), the
    bf16 pool keeps bf16 rows, and both dispatch steps are timed."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_MXFP4.replace("weights: mxfp4", "weights: fp8").replace("hidden: 64", "hidden: 128")
                      .replace("intermediate: 64", "intermediate: 128"))
    rows = main([str(config), "--dispatch", "fp8", "--backend", "triton" if use_triton(DEVICE) else "torch"])
    for row in rows:
        assert row["dispatch"] == "fp8" and set(row["dispatch_us"]) == {"packed", "bf16"}
        assert row["source"] == source_digest()
        assert min(row["dispatch_us"].values()) > 0 and min(row["experts_us_max"].values()) > 0
        assert row["ratio"]["bf16"] == 1.0


def test_source_digest_follows_the_python_files(tmp_path):
    """The digest names the .py files' paths and bytes: the same tree gives the same digest, a
    changed or moved file another one, other files none."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0 and source_digest(tmp_path) == first
    (tmp_path / "notes.txt").write_text("not code")
    assert source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = source_digest(tmp_path)
    assert changed != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b.py")
    assert source_digest(tmp_path) not in (first, changed)


@pytest.mark.parametrize("options, message", [
    (["--arm", "dense"], "--arm must be an EP arm"), (["--arm", "nope"], "arm must be one of"),
    (["--tokens", "0"], "--tokens must be positive"), (["--maxvio", "-1"], "--maxvio at least 0"),
    (["--against", "HEAD"], "--against and --in-turn change the packed GEMMs"),
    (["--in-turn"], "--against and --in-turn change the packed GEMMs"),
])
def test_bad_options_are_refused(tmp_path, options, message, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_MXFP4)
    if options in (["--against", "HEAD"], ["--in-turn"]):  # nothing to swap in a bf16 pool
        config.write_text(TINY_MXFP4.replace("weights: mxfp4", "weights: bf16"))
    with pytest.raises((SystemExit, ValueError)) as raised:
        main([str(config), *options])
    shown = capsys.readouterr().err if raised.type is SystemExit else str(raised.value)
    assert message in shown
