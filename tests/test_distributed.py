"""Issue 8 (8): two CPU processes train a model holding a Substation layer under torch.distributed
DistributedDataParallel (gloo backend, file:// rendezvous, loopback only) and end with identical
parameters, equal to single-process full-batch training of the fp64 reference."""
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from conftest import NO_DROPOUT, make_layer
from substation.config import load_config
from substation.reference import ReferenceEncoderLayer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_worker  # noqa: E402

CONFIG = load_config("tiny").replace(dropout=NO_DROPOUT)  # float64, I=16, H=4, U=24
WORLD = 2


def test_ddp_two_processes_end_with_identical_parameters(tmp_path):
    make_layer(CONFIG)  # build (or find) the libraries once, so the workers load them from the cache
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{r}.pt" for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "ddp_worker.py"), str(r), str(WORLD), init,
                               str(outs[r]), json.dumps(CONFIG.to_dict())],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(WORLD)]
    try:
        logs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, [e[-3000:] for _, e in logs]
    ranks = [torch.load(o) for o in outs]

    # the ranks started from different parameters; DDP broadcast rank 0's
    assert any(not torch.equal(ranks[0]["before"][n], ranks[1]["before"][n]) for n in ranks[0]["before"])
    for n in ranks[0]["start"]:
        assert torch.equal(ranks[0]["start"][n], ranks[0]["before"][n])
        assert torch.equal(ranks[1]["start"][n], ranks[0]["start"][n]), n
    # the same parameters at the end, bit for bit, after training moved them
    for n in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]), n
    assert any((ranks[0]["params"][n] - ranks[0]["start"][n]).abs().max() > 1e-4 for n in ranks[0]["params"])
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank saw its own shard

    # single-process, full-batch training of the float64 reference from the same start
    ref = ddp_worker.Model(ReferenceEncoderLayer(CONFIG, torch.float64), CONFIG.hidden_size)
    ref.load_state_dict(ranks[0]["start"])
    x, target, pad = ddp_worker.data(WORLD, CONFIG.hidden_size)
    opt = torch.optim.SGD(ref.parameters(), lr=ddp_worker.LR)
    shard_losses = []
    for _ in range(ddp_worker.STEPS):
        opt.zero_grad()
        y = ref(x, pad)
        loss = F.mse_loss(y, target)  # = mean of the equal-sized shards' losses
        loss.backward()
        opt.step()
        b = ddp_worker.BATCH_PER_RANK
        shard_losses.append([F.mse_loss(y[r * b:(r + 1) * b], target[r * b:(r + 1) * b]).item() for r in range(WORLD)])
    for r in range(WORLD):
        assert max(abs(a - s[r]) for a, s in zip(ranks[r]["losses"], shard_losses)) <= 1e-12
    for n, p in ref.named_parameters():
        err = float((ranks[0]["params"][n] - p.detach()).abs().max() / p.detach().abs().max())
        assert err <= 1e-10, (n, err)
