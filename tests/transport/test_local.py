import pytest
import torch

from flatep import init_group


def test_local_group_buffers_and_peer_offsets():
    group = init_group("local", ranks=3, device="cpu")
    buffer = group.buffer("shard", (5, 4), torch.float32)
    assert buffer.shape == (3, 5, 4)
    assert group.buffer("shard", (5, 4), torch.float32) is buffer  # cached: fixed addresses
    assert group.peer_offsets(buffer).tolist() == [0, 20, 40]
    assert group.peer_offsets(buffer) is group.peer_offsets(torch.empty(3, 20))  # one table per stride
    assert group.peer_offsets(torch.empty(3, 7)).tolist() == [0, 7, 14]
    assert group.all_gather(buffer) is buffer
    group.close()
    assert group.buffer("shard", (5, 4), torch.float32) is not buffer


def test_init_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match="transport must be one of"):
        init_group("carrier-pigeon", ranks=2)
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        init_group("local", ranks=0, device="cpu")
