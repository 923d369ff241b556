"""Result set: the count kernel's shape on the GPU (bench/results/2026-12-03-h200-b/planner_count_shapes.json).

    python3 bench/scripts/planner_count_shapes.py        (from the repository root, OUT=folder for the JSON)

For Kimi-K3 and Kimi-K2 at R=8 (s = 8192, 1024, 128; routing sigma 1), rank 7's whole planning
(``count_rank_triton`` then ``plan_rank_triton(counts=...)``), the count alone and the plan after
the exchange alone, CUDA-graph timing (20 calls per graph, median of 50 replays), for entries per
tile (the planner's choice, 64, 256) times segments per rank (1<<20 = one tile per segment, then
1024 down to 64; a segment holds at most 8 tiles, so several settings give the same shape: each
row names the shape it ran). Sets the planner's module constants for the run.
"""
import json, os
import torch
import flatep.plan.triton as planner
from flatep.bench.planner import model_config
from flatep.bench.timing import time_us
from flatep.routing import skewed_topk
out = []
dev = torch.device("cuda")
for model, step in (("kimi-k3", 8192), ("kimi-k2", 8192), ("kimi-k3", 1024), ("kimi-k3", 128), ("kimi-k2", 128)):
    config = model_config(model, 8, step)
    ids = skewed_topk(8, config.experts, config.top_k, step, 1.0, device=dev).int()
    hist = torch.stack([planner.count_rank_triton(ids[r], config.experts).tokens_per_expert for r in range(8)])
    base_tile = planner._tile_size
    for tile in (None, 64, 256):
        for segments in (1 << 20, 1024, 512, 256, 128, 64):
            planner._SEGMENTS_PER_RANK = segments
            planner._tile_size = base_tile if tile is None else (lambda e, t=tile: t)
            def total():
                c = planner.count_rank_triton(ids[7], config.experts)
                planner.plan_rank_triton(7, ids[7], hist, config, "exact", counts=c)
            def count():
                planner.count_rank_triton(ids[7], config.experts)
            c0 = planner.count_rank_triton(ids[7], config.experts)
            def after():
                planner.plan_rank_triton(7, ids[7], hist, config, "exact", counts=c0)
            meta = planner._count_meta(step * config.top_k, config.experts)
            row = dict(model=model, s=step, tile=meta["TILE"], tiles=meta["TILES"],
                       segments=planner._segments(step * config.top_k, meta),
                       total_us=time_us(total, dev, iters=50, graph=True, calls=20),
                       count_us=time_us(count, dev, iters=50, graph=True, calls=20),
                       after_us=time_us(after, dev, iters=50, graph=True, calls=20))
            print(json.dumps(row), flush=True)
            out.append(row)
    planner._tile_size = base_tile
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "planner_variants.json"), "w"), indent=1)
