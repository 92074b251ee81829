"""One rank of tests/test_distributed.py: trains a model holding a Substation layer under
DistributedDataParallel (gloo, file:// rendezvous, loopback only) and saves what it ends with.

Usage: python ddp_worker.py RANK WORLD_SIZE INIT_METHOD OUT_FILE CONFIG_JSON
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BATCH_PER_RANK, SEQ, STEPS, LR = 2, 6, 4, 0.05


class Model(nn.Module):
    """An encoder layer (compiled or the reference) followed by a linear head."""

    def __init__(self, layer: nn.Module, hidden: int):
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(hidden, hidden, dtype=torch.float64)

    def forward(self, x, pad):
        from substation.reference import ReferenceEncoderLayer
        if isinstance(self.layer, ReferenceEncoderLayer):  # additive mask
            return self.head(self.layer(x, torch.zeros(pad.shape, dtype=x.dtype).masked_fill(pad, float("-inf"))))
        return self.head(self.layer(x, key_padding_mask=pad))


def data(world: int, hidden: int):
    """The global batch (same on every rank): inputs, targets and a padding mask."""
    g = torch.Generator().manual_seed(0)
    b = world * BATCH_PER_RANK
    x = torch.randn(b, SEQ, hidden, dtype=torch.float64, generator=g)
    target = torch.randn(b, SEQ, hidden, dtype=torch.float64, generator=g)
    pad = torch.zeros(b, SEQ, dtype=torch.bool)
    pad[1::2, SEQ - 2:] = True
    return x, target, pad


def main() -> int:
    rank, world, init, out, config = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    from substation import EncoderLayer
    from substation.pipeline import compile_layer

    compiled = compile_layer(json.loads(config))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(100 + rank)  # every rank starts from different parameters: DDP broadcasts rank 0's
    model = Model(EncoderLayer(compiled), compiled.config.hidden_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, target, pad = data(world, compiled.config.hidden_size)
    shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(ddp(x[shard], pad[shard]), target[shard])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save({"before": before, "start": start, "losses": losses,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's worker threads can abort it ("terminate called without an active
    # exception", SIGABRT) after the work, the results file and destroy_process_group are all done.
    os._exit(code)
