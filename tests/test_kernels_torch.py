import pytest
import torch

from paged_case import dense_reference, make_case
from radixrt.kernels import torch_ref

SCALE = 8**-0.5


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 3])
def test_extend_matches_dense(page_size, window):
    case = make_case(prefix_lens=[0, 5, 17, 3], extend_lens=[7, 1, 4, 9], page_size=page_size)
    out = torch_ref.extend_attention(
        case.q, case.k_cache, case.v_cache, case.page_table, case.prefix_lens, case.extend_lens, SCALE, window
    )
    torch.testing.assert_close(out.double(), dense_reference(case, SCALE, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 3])
def test_decode_matches_dense(page_size, window):
    case = make_case(prefix_lens=[0, 6, 30, 15, 2], extend_lens=[1] * 5, page_size=page_size)
    out = torch_ref.decode_attention(case.q, case.k_cache, case.v_cache, case.page_table, case.seq_lens, SCALE, window)
    torch.testing.assert_close(out.double(), dense_reference(case, SCALE, window), atol=1e-5, rtol=0)


def test_bf16_within_tolerance():
    case = make_case(prefix_lens=[9, 0], extend_lens=[3, 5], page_size=4, dtype=torch.bfloat16)
    out = torch_ref.extend_attention(
        case.q, case.k_cache, case.v_cache, case.page_table, case.prefix_lens, case.extend_lens, SCALE
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(case, SCALE), atol=2e-2, rtol=2e-2)


def test_store_kv_writes_slots():
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    torch_ref.store_kv(k_cache, v_cache, torch.tensor([5, 0, 2]), k, -k)
    assert torch.equal(k_cache[2, 1, 0], k[0, 0]) and torch.equal(k_cache[0, 0, 0], k[1, 0])
    assert torch.equal(k_cache[1, 0, 0], k[2, 0]) and torch.equal(v_cache[1, 0, 0], -k[2, 0])
