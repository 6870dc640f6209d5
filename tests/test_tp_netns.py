"""Tensor parallel over two "hosts" on one machine: tp 2, one rank in each of two network namespaces.

Two namespaces joined by a veth pair (10.231.0.1 and 10.231.0.2); node 0 (`radixrt serve --node-rank 0`, HTTP
and rank 0) runs in the first, node 1 in the second, each with GLOO_SOCKET_IFNAME set to its veth end. The
greedy tokens must equal tp 1's. The namespaces are made by the test and always deleted. Making them needs
root: as root a failure to make them fails the test; otherwise the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from test_tensor_parallel import GREEDY, PROMPTS, greedy, save_model

pytestmark = [pytest.mark.model, pytest.mark.slow]  # node start-up over gloo: about a minute on two cores

ADDRS = ("10.231.0.1", "10.231.0.2")
PORT = 29731  # fixed ports are free: each namespace has a network stack of its own


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


@pytest.fixture
def namespaces():
    """Two namespaces and the veth end in each: [(ns, ifname, addr), ...]; deleted at the end."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    spaces = [(f"rrt{tag}{i}", f"vrrt{tag}{i}", ADDRS[i]) for i in range(2)]
    made: list[str] = []
    try:
        try:
            for ns, _, _ in spaces:
                _ip("netns", "add", ns)
                made.append(ns)
            _ip("link", "add", spaces[0][1], "type", "veth", "peer", "name", spaces[1][1])
            for ns, ifname, addr in spaces:
                _ip("link", "set", ifname, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (OSError, RuntimeError) as exc:
            pytest.fail(f"running as root, but could not make two network namespaces with a veth pair: {exc}")
        yield spaces
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


CLIENT = """
import json, sys, time, httpx
url, prompts, params = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
deadline = time.monotonic() + 280
while True:
    try:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("node 0 never became ready")
    time.sleep(0.5)
outs = [httpx.post(url + "/generate", json={"input_ids": p, "sampling_params": params}, timeout=120)
        .json()["output_ids"] for p in prompts]
print(json.dumps(outs))
"""


def _in_ns(ns: str, ifname: str, argv: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "GLOO_SOCKET_IFNAME": ifname}
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdin=subprocess.DEVNULL, **kwargs)


def test_tp2_across_two_network_namespaces_matches_tp1(tmp_path, default_model_path, namespaces):
    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    expected = greedy(model, 1)
    (ns0, if0, addr0), (ns1, if1, _) = namespaces
    common = [sys.executable, "-m", "radixrt.cli", "serve", "--model", model, "--dtype", "float32", "--tp-size", "2",
              "--nnodes", "2", "--max-total-pages", "64", "--log-interval", "0", "--dist-init-addr",
              f"{addr0}:{PORT}"]
    nodes = [_in_ns(ns0, if0, [*common, "--node-rank", "0", "--host", "127.0.0.1", "--port", "30000"]),
             _in_ns(ns1, if1, [*common, "--node-rank", "1"])]
    try:
        client = subprocess.run(["ip", "netns", "exec", ns0, sys.executable, "-c", CLIENT, "http://127.0.0.1:30000",
                                 json.dumps(PROMPTS), json.dumps(GREEDY)], capture_output=True, text=True,
                                timeout=400)
        assert client.returncode == 0, client.stderr[-2000:]
        assert json.loads(client.stdout.strip().splitlines()[-1]) == expected
        nodes[0].terminate()
        assert nodes[0].wait(timeout=60) == 0
        assert nodes[1].wait(timeout=60) == 0  # rank 0 stopped: the other namespace's rank stops too
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
