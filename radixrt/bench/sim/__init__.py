"""A randomized simulation of the scheduler: the real Scheduler, PagePool and RadixCache driven by a fake
model runner whose logits depend on the KV it reads back, thousands of steps a second.

    from radixrt.bench.sim import Knobs, run_seed
    result = run_seed(Knobs.from_seed(7))       # SeedResult: counters and failures
    assert result.ok, result.failures

Modules: ``world`` (tokenizer, word tokens, grammars; built once), ``fake_runner`` (the model stand-in),
``workload`` (knobs and the requests they generate), ``oracle`` (scheduler construction and the solo
reference), ``driver`` (one seed, step by step, with every check). ``python -m radixrt.bench.soak`` runs many.
"""

from radixrt.bench.sim.driver import SeedResult, Simulation, run_seed
from radixrt.bench.sim.oracle import SoloOracle
from radixrt.bench.sim.workload import Knobs, Workload, generate
from radixrt.bench.sim.world import World, load_world

__all__ = ["Knobs", "SeedResult", "Simulation", "SoloOracle", "World", "Workload", "generate", "load_world",
           "run_seed"]
