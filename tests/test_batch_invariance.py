"""Where radixrt's own CPU kernels run every product, speculation changes no token and no logprob: a verify row
gets the bits of the decode row it stands for, and a decoding request gets the same bits whichever requests decode
beside it (with speculation they advance at different rates, so the decode kernel's shared-prefix groups differ
from step to step). That holds in bf16 on AVX512-BF16 without AMX (the bf16 panel GEMM and the bf16 decode
kernel) and in fp32 where the fp32 panel GEMM runs (AVX2 without AVX-512, and Zen 4).

Each piece computes a row the same way whatever rows come with it (tests/test_cpu_linear.py,
tests/test_kernels_cascade.py); here the whole scheduler is held to it: four requests with a common 150-token
prompt (the decode kernel walks the shared part once for them) and copy-friendly text (drafts are accepted),
decoded together and one after another, speculation off and on, compared to the last bit of their logprobs. Not
claimed: a prompt prefilled with part of it cached rounds differently from one prefilled whole, so a request
alone and the same request in a batch are not compared with each other.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels import cpu_kernels
from radixrt.model import cpu_linear
from radixrt.sampling.params import SamplingParams
from exact_runs import logprob_runs

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = pytest.mark.serial

NEW_TOKENS = 40

OWN_KERNELS = {
    "bfloat16": cpu_kernels.bf16_dot_built() and (
        (cpu_kernels.linear_bf16_built() and cpu_linear.prefers_bf16_panels(cpu_kernels.cpu_flags()))
        or (cpu_kernels.linear_amx_usable() and cpu_linear.prefers_amx(cpu_kernels.cpu_flags()))),
    "float32": (cpu_kernels.linear_panels_usable()
                and cpu_linear.prefers_panels(cpu_kernels.cpu_flags(), cpu_kernels.cpu_model())),
}
KERNEL = {"bfloat16": "amx" if cpu_linear.prefers_amx(cpu_kernels.cpu_flags()) else "bf16", "float32": "panels"}


def decode(folder, dtype: str, prompts: list[list[int]], together: bool, speculative: bool
           ) -> tuple[list[list], int]:
    """Greedy tokens of each prompt with their logprobs and top-5 logprobs (all submitted at once, or each after
    the previous finished), and how many draft tokens were accepted."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    requests = [(ids, params) for ids in prompts]
    groups = [requests] if together else [[request] for request in requests]
    return logprob_runs(folder, dtype, groups, speculative=speculative)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_and_logprobs_are_the_same_with_speculation_alone_and_together(tiny_hd64, dtype):
    if not OWN_KERNELS[dtype]:
        pytest.skip(f"{dtype} products run on oneDNN on this CPU, whose rounding may depend on the row count; the "
                    "kernels' own row invariance is tested on every CPU in test_cpu_linear.py and "
                    "test_kernels_cascade.py")
    shared = [1 + (i * 7) % 23 for i in range(150)]  # a repeating pattern: drafts from the context get accepted
    prompts = [shared + [100 + r, 101 + r, 102 + r] for r in range(4)]
    assert cpu_linear.choose_kernel(torch.zeros(2, 64, dtype=getattr(torch, dtype))) == KERNEL[dtype]
    plain_together, _ = decode(tiny_hd64, dtype, prompts, together=True, speculative=False)
    spec_together, accepted = decode(tiny_hd64, dtype, prompts, together=True, speculative=True)
    assert accepted > 0, "the drafts must really be verified for the comparison to mean anything"
    assert spec_together == plain_together
    plain_alone, _ = decode(tiny_hd64, dtype, prompts[:2], together=False, speculative=False)
    spec_alone, _ = decode(tiny_hd64, dtype, prompts[:2], together=False, speculative=True)
    assert spec_alone == plain_alone
