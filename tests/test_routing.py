import pytest
import torch

from flatep.routing import adversarial_topk, expert_histogram, maxvio, sigma_for_maxvio, skewed_topk


def test_skewed_topk_shape_distinct_and_reproducible():
    ids = skewed_topk(4, 32, 6, 50, sigma=1.5, seed=3)
    assert ids.shape == (4, 50, 6) and ids.dtype == torch.int32
    assert bool(((ids >= 0) & (ids < 32)).all())
    assert all(len(set(row)) == 6 for row in ids.view(-1, 6).tolist())
    assert torch.equal(ids, skewed_topk(4, 32, 6, 50, sigma=1.5, seed=3))
    assert not torch.equal(ids, skewed_topk(4, 32, 6, 50, sigma=1.5, seed=4))


def test_hot_experts_line_up_across_ranks():
    ids = skewed_topk(4, 64, 2, 400, sigma=3.0)
    hottest = [int(expert_histogram(ids[r], 64).argmax()) for r in range(4)]
    assert len(set(hottest)) == 1


def test_sigma_zero_is_balanced_and_distinct():
    ids = skewed_topk(8, 64, 8, 64, sigma=0.0)
    assert maxvio(ids, 64) == 0.0
    assert all(len(set(row)) == 8 for row in ids.view(-1, 8).tolist())


def test_maxvio_definition():
    ids = torch.tensor([[[0], [0], [1], [-1]]])
    assert maxvio(ids, 2) == pytest.approx(2 / 1.5 - 1)
    with pytest.raises(ValueError, match="no valid entry"):
        maxvio(torch.full((1, 2, 1), -1), 2)


@pytest.mark.parametrize("target", [0.5, 2.0, 10.0])
def test_sigma_bisection_reaches_target(target):
    sigma, reached = sigma_for_maxvio(target, 8, 64, 4, 256)
    assert abs(reached - target) <= max(0.02 * target, 0.005)
    assert maxvio(skewed_topk(8, 64, 4, 256, sigma), 64) == pytest.approx(reached)


def test_adversarial_kinds():
    local = adversarial_topk("local", 4, 8, 2, 5)
    assert bool((local // 2 == torch.arange(4).view(4, 1, 1)).all())
    following = adversarial_topk("next", 4, 8, 2, 5)
    assert bool((following // 2 == (torch.arange(4).view(4, 1, 1) + 1) % 4).all())
    assert bool((adversarial_topk("one", 4, 8, 2, 5) == 0).all())
    duplicate = adversarial_topk("duplicate", 4, 8, 3, 5)
    assert bool((duplicate == duplicate[..., :1]).all())
    with pytest.raises(ValueError, match="kind must be one of"):
        adversarial_topk("bad", 4, 8, 2, 5)
