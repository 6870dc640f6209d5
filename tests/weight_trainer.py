"""A trainer's side of updates of weights by broadcast, as a reinforcement-learning trainer runs it beside a
runtime (``start_trainer`` starts it for the tests): rank 0 of the weight group, hosting its rendezvous,
broadcasting the tensors of a checkpoint round after round.

    python tests/weight_trainer.py PORT CHECKPOINT PLAN.json

PLAN: ``{"rounds": [[tensor names], ...], "die_after": n | null, "group_name": str}``: each round's tensors in
order, a line ``sent R`` on stdout after round R; with ``die_after`` the process ends abruptly after that many
tensors (a trainer that crashed mid-update).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

GROUP = "weight_update_group"


def start_trainer(folder: Path, checkpoint: Path, rounds: list[list[str]],
                  die_after: int | None = None) -> tuple[subprocess.Popen, int]:
    """The trainer's process, broadcasting ``rounds`` of ``checkpoint``'s tensors, and the port of its rendezvous
    (its plan written into ``folder``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"rounds": rounds, "die_after": die_after, "group_name": GROUP}))
    trainer = subprocess.Popen([sys.executable, __file__, str(port), str(checkpoint), str(plan)],
                               stdout=subprocess.PIPE, text=True)
    return trainer, port


def announce(tensors) -> dict:
    """What an update by broadcast names of ``(name, tensor)`` pairs: their names, dtypes and shapes."""
    return {"names": [name for name, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def main(port: int, checkpoint: Path, plan: dict) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from radixrt.model.weight_group import destroy, init_custom_process_group

    tensors: dict = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, plan["group_name"])
    print("joined", flush=True)
    sent = 0
    for number, names in enumerate(plan["rounds"]):
        for name in names:
            if sent == plan.get("die_after"):
                os._exit(3)
            dist.broadcast(tensors[name].contiguous(), src=0, group=group)
            sent += 1
        print(f"sent {number}", flush=True)
    destroy(group)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()))
